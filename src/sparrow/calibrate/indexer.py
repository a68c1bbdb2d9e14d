"""Indexer fitting: low-rank projections of pre-RoPE q / k that predict where a retrieval head attends.

For every retrieval kv head the indexer scores key ``j`` for query ``i`` as
``(W_q^T qg_i) . (W_k^T k_j)``, where ``qg_i`` concatenates the pre-RoPE queries of the head's query group
and ``k_j`` is the pre-RoPE key (``r = 16`` dims by default).

1. Initialisation from calibration statistics: the rank-``r`` bilinear form closest, under the data's
   second moments ``C_q``, ``C_k``, to the group's mean pre-RoPE logit ``mean_g q_g . k / sqrt(d)``:
   the SVD of ``C_q^{1/2} M C_k^{1/2}`` whitened back (a PCA that weighs the directions q and k share).
2. Distillation with the model frozen: minimise the forward KL from the head's true attention
   distribution (post-RoPE, averaged over the query group) to the indexer's softmax, over sampled queries.
3. Temperature calibration: forward KL makes a low-rank student *mass-covering* — its softmax is flatter than
   the attention where it cannot rank exactly, so the top ``p`` of the indexer's mass holds more of the
   attention's mass, in more blocks, than the attention's own top-p set. Each head gets the sharpest temperature
   ``T`` (scores divided by ``T``) at which the indexer's top-p blocks still hold, on held-out queries, as much of
   the attention's mass as the attention's own top-p blocks do (``mass_target``): the indexer's selection is then
   as large as it must be to be as good as the dense one, and no larger. An indexer that ranks exactly keeps
   ``T = 1``; one that is over-confident gets ``T > 1``.

The report gives, per head, on held-out queries: the density of the dense attention's own top-p block set, and,
for the indexer's top-p selection at the calibrated temperature (and at temperature 1), its density, the
teacher mass it covers, and its recall of the dense set (fraction of those blocks it keeps).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from sparrow.attention.rtpurbo import HeadProfile, IndexerWeights, RTPurboAttention, rtpurbo_backends
from sparrow.calibrate.capture import capture_attention
from sparrow.calibrate.profile import CalibrationSequence
from sparrow.kernels.topp.reference import topp_mask_reference
from sparrow.models.attention import attention_modules


def mean_over(heads: Sequence, name: str, *, skip_nan: bool = False) -> float:
    """The mean of attribute ``name`` over ``heads`` (each head weighs the same; ``skip_nan``: NaN entries, heads
    without data, left out); NaN when nothing is left."""
    vals = [getattr(h, name) for h in heads]
    vals = [v for v in vals if not (skip_nan and math.isnan(v))]
    return sum(vals) / len(vals) if vals else float("nan")


@dataclass
class HeadReport:
    """One retrieval head on held-out queries (block granularity, no forced blocks)."""

    layer: int
    kv_head: int
    recall: float  # fraction of the dense top-p blocks kept by the indexer's top-p selection
    mass: float  # teacher attention mass inside the indexer's selection
    density: float  # kept blocks / causal blocks
    kl_init: float
    kl_final: float
    dense_density: float = float("nan")  # the dense attention's own top-p set: its blocks / causal blocks
    temperature: float = 1.0  # the calibrated temperature (recall, mass, density above are at it)
    density_t1: float = float("nan")  # the indexer's density at temperature 1
    mass_t1: float = float("nan")  # ... and the teacher mass it covers


@dataclass
class IndexerReport:
    heads: list[HeadReport] = field(default_factory=list)
    steps: int = 0
    top_p: float = 0.9
    block: int = 64

    def mean(self, name: str) -> float:
        return mean_over(self.heads, name)

    def summary(self) -> dict:
        return {"steps": self.steps, "top_p": self.top_p, "block": self.block, "num_heads": len(self.heads),
                **{k: self.mean(k) for k in ("recall", "mass", "density", "dense_density", "temperature",
                                             "density_t1", "mass_t1", "kl_init", "kl_final")}}

    def table(self) -> str:
        cols = [("recall", 7), ("mass", 6), ("density", 8), ("dense_density", 8), ("temperature", 6),
                ("density_t1", 8), ("mass_t1", 7), ("kl_init", 8), ("kl_final", 8)]
        names = {"dense_density": "dense", "temperature": "T", "density_t1": "dens@T1", "mass_t1": "mass@T1",
                 "kl_init": "KL init", "kl_final": "KL final"}
        rows = [f"{'layer':>5} {'kv':>3} " + " ".join(f"{names.get(c, c):>{w}}" for c, w in cols)]
        for h in self.heads:
            rows.append(f"{h.layer:>5} {h.kv_head:>3} " + " ".join(f"{getattr(h, c):>{w}.3f}" for c, w in cols))
        s = self.summary()
        rows.append(f"{'mean':>9} " + " ".join(f"{s[c]:>{w}.3f}" for c, w in cols))
        return "\n".join(rows)


@dataclass
class _HeadData:
    """Per (layer, kv head) training data over all sequences."""

    layer: int
    kv_head: int
    qg: list[torch.Tensor] = field(default_factory=list)  # [Nq, qpk*D] sampled pre-RoPE group queries
    qpos: list[torch.Tensor] = field(default_factory=list)  # [Nq] their positions
    k: list[torch.Tensor] = field(default_factory=list)  # [S, D] pre-RoPE keys
    teacher: list[torch.Tensor] = field(default_factory=list)  # [Nq, S] attention probabilities
    cq: torch.Tensor | None = None  # second moments
    ck: torch.Tensor | None = None
    n_q: int = 0
    n_k: int = 0


def _tokens(s) -> torch.Tensor:
    return s.tokens if isinstance(s, CalibrationSequence) else torch.as_tensor(s, dtype=torch.int64).flatten()


@torch.no_grad()
def _collect(model: nn.Module, profile: HeadProfile, sequences: Sequence, queries_per_seq: int,
             seed: int, progress: bool) -> dict[tuple[int, int], _HeadData]:
    mods = attention_modules(model)
    heads = {(l, h): _HeadData(l, h) for l in range(len(mods)) for h in profile.retrieval_heads(l)}
    layers = {l for l, _ in heads}
    device = next(model.parameters()).device
    rng = torch.Generator().manual_seed(seed)
    current: dict = {}

    def cb(layer: int, t: dict[str, torch.Tensor]) -> None:
        q, k = t["q"][0].float(), t["k"][0].float()
        q_pre, k_pre = t["q_pre"][0].float(), t["k_pre"][0].float()
        hq, S, D = q.shape
        hkv = k.shape[0]
        qpk = hq // hkv
        pos = current["pos"].to(q.device)
        j = torch.arange(S, device=q.device)
        for h in profile.retrieval_heads(layer):
            d = heads[(layer, h)]
            grp = slice(h * qpk, (h + 1) * qpk)
            logits = torch.einsum("gid,jd->gij", q[grp][:, pos], k[h]) / math.sqrt(D)
            logits = logits.masked_fill(j[None, None, :] > pos[None, :, None], float("-inf"))
            d.teacher.append(torch.softmax(logits, -1).mean(0))  # [Nq, S]
            qg_all = q_pre[grp].permute(1, 0, 2).reshape(S, qpk * D)  # [S, qpk*D]
            d.qg.append(qg_all[pos])
            d.qpos.append(pos)
            d.k.append(k_pre[h])
            cq, ck = qg_all.T @ qg_all, k_pre[h].T @ k_pre[h]
            d.cq = cq if d.cq is None else d.cq + cq
            d.ck = ck if d.ck is None else d.ck + ck
            d.n_q += S
            d.n_k += S

    it = list(sequences)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="collect attention", unit="seq")
    with capture_attention(model, cb, layers=layers):
        for s in it:
            tok = _tokens(s)
            S = tok.numel()
            n = min(queries_per_seq, S - 1)
            # sampled queries (never position 0, whose distribution is trivial)
            current["pos"] = torch.sort(torch.randperm(S - 1, generator=rng)[:n] + 1).values
            model(tok[None].to(device))
    return heads


def _init_from_stats(d: _HeadData, dim: int, qpk: int, D: int, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``dim`` whitened-SVD initialisation (see module docstring)."""
    cq = (d.cq / d.n_q).double()
    ck = (d.ck / d.n_k).double()

    def sqrt_and_inv(c):
        w, v = torch.linalg.eigh(c)
        w = w.clamp_min(0) + ridge * w.clamp_min(0).mean().clamp_min(1e-12)
        return (v * w.sqrt()) @ v.T, (v * w.rsqrt()) @ v.T

    cq_h, cq_ih = sqrt_and_inv(cq)
    ck_h, ck_ih = sqrt_and_inv(ck)
    m = torch.eye(D, dtype=torch.float64, device=cq.device).repeat(qpk, 1) / (qpk * math.sqrt(D))  # [qpk*D, D]
    u, s, vh = torch.linalg.svd(cq_h @ m @ ck_h)
    r = min(dim, s.numel())
    sr = s[:r].sqrt()
    wq = cq_ih @ (u[:, :r] * sr)
    wk = ck_ih @ (vh[:r].T * sr)
    if r < dim:  # fewer directions than dims: pad with zeros
        wq = torch.nn.functional.pad(wq, (0, dim - r))
        wk = torch.nn.functional.pad(wk, (0, dim - r))
    return wq.float(), wk.float()


def _student_logp(wq: torch.Tensor, wk: torch.Tensor, qg: torch.Tensor, k: torch.Tensor, pos: torch.Tensor):
    s = (qg @ wq) @ (k @ wk).T  # [Nq, S]
    j = torch.arange(k.shape[0], device=k.device)
    s = s.masked_fill(j[None, :] > pos[:, None], float("-inf"))
    return torch.log_softmax(s, -1)


def _kl(teacher: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(teacher || student) (terms with teacher 0 contribute 0)."""
    t = teacher.clamp_min(1e-30)
    term = torch.where(teacher > 0, teacher * (t.log() - logp.clamp_min(-1e30)), torch.zeros_like(teacher))
    return term.sum(-1).mean()


def _topp_blocks(prob: torch.Tensor, pos: torch.Tensor, block: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block masses of per-query distributions [Nq, S] -> (selected top-p blocks [Nq, NB], valid blocks)."""
    nq, S = prob.shape
    nb = -(-S // block)
    mass = torch.nn.functional.pad(prob, (0, nb * block - S)).view(nq, nb, block).sum(-1)
    valid = torch.arange(nb, device=prob.device)[None, :] <= (pos // block)[:, None]
    return topp_mask_reference(mass.clamp_min(1e-30).log(), valid, top_p), valid


class _EvalSet:
    """A head's held-out queries, prepared once: the teacher's block masses and top-p blocks, the indexer's raw
    scores; :meth:`at` evaluates the indexer's selection at a temperature."""

    def __init__(self, d: _HeadData, wq, wk, idx: list[tuple[int, torch.Tensor]], block: int, top_p: float):
        self.block, self.top_p, self.parts = block, top_p, []
        for si, rows in idx:
            pos = d.qpos[si][rows]
            teacher = d.teacher[si][rows]
            t_sel, valid = _topp_blocks(teacher, pos, block, top_p)
            S = teacher.shape[1]
            nb = t_sel.shape[1]
            tmass = torch.nn.functional.pad(teacher, (0, nb * block - S)).view(-1, nb, block).sum(-1)
            scores = (d.qg[si][rows] @ wq) @ (d.k[si] @ wk).T  # [Nq, S]
            causal = torch.arange(S, device=scores.device)[None, :] <= pos[:, None]
            self.parts.append((pos, scores.masked_fill(~causal, float("-inf")), tmass, t_sel, valid))
        self.n = max(sum(p[0].numel() for p in self.parts), 1)

    def dense_density(self) -> float:
        return sum(float((t.sum(-1).float() / v.sum(-1).clamp_min(1)).sum()) for _, _, _, t, v in self.parts) / self.n

    def dense_mass(self) -> float:
        """Mean teacher mass of the dense top-p blocks (at least ``top_p``: the last block overshoots)."""
        return sum(float((m * t).sum()) for _, _, m, t, _ in self.parts) / self.n

    def at(self, temperature: float) -> tuple[float, float, float]:
        """(recall of the dense top-p blocks, teacher mass covered, density) of the indexer's top-p selection with
        its scores divided by ``temperature``."""
        rec = mass = dens = 0.0
        for pos, scores, tmass, t_sel, valid in self.parts:
            student = torch.softmax(scores / temperature, -1)
            s_sel, _ = _topp_blocks(student, pos, self.block, self.top_p)
            rec += float(((t_sel & s_sel).sum(-1).float() / t_sel.sum(-1).clamp_min(1)).sum())
            mass += float((tmass * s_sel).sum(-1).sum())
            dens += float((s_sel.sum(-1).float() / valid.sum(-1).clamp_min(1)).sum())
        return rec / self.n, mass / self.n, dens / self.n


TEMPERATURES = tuple(float(t) for t in torch.logspace(-3, 3, 37, base=2.0))  # 1/8 .. 8, 6 steps per octave


def fit_temperature(evals: _EvalSet, target: float) -> float:
    """The sharpest temperature of :data:`TEMPERATURES` whose selection still covers ``target`` of the teacher's
    mass on average (the flattest one when none does: the most mass this indexer can cover)."""
    covered = {t: evals.at(t)[1] for t in TEMPERATURES}
    ok = [t for t in TEMPERATURES if covered[t] >= target]
    return min(ok) if ok else max(TEMPERATURES, key=lambda t: (covered[t], t))


def _kl_on(d: _HeadData, wq, wk, idx) -> float:
    tot, n = 0.0, 0
    for si, rows in idx:
        lp = _student_logp(wq, wk, d.qg[si][rows], d.k[si], d.qpos[si][rows])
        tot += float(_kl(d.teacher[si][rows], lp)) * rows.numel()
        n += rows.numel()
    return tot / max(n, 1)


def fit_indexer(
    model: nn.Module,
    profile: HeadProfile,
    sequences: Sequence,
    *,
    steps: int = 600,
    dim: int = 16,
    lr: float = 3e-3,
    queries_per_seq: int = 256,
    batch_queries: int = 64,
    top_p: float = 0.9,
    block: int = 64,
    holdout: float = 0.2,
    init: IndexerWeights | None = None,
    calibrate_temperature: bool = True,
    mass_target: float | None = None,
    seed: int = 0,
    progress: bool = False,
) -> tuple[IndexerWeights, IndexerReport]:
    """Fit the indexer of every retrieval head of ``profile`` by forward-KL distillation, model frozen.

    Args:
        model: a Sparrow model (any attention backend: its dense ``forward`` is the teacher).
        profile: the retrieval heads to fit.
        sequences: calibration token sequences (:class:`CalibrationSequence` or 1-D token tensors / lists).
        steps: optimiser steps (Adam, ``lr``); each step draws ``batch_queries`` queries of one sequence
            for every head.
        dim: indexer dimension. queries_per_seq: queries sampled per sequence (the rest of the positions
            only serve as keys). holdout: fraction of sampled queries kept out of training for the report.
        init: start from these weights instead of the statistics-based initialisation (indexer refresh).
        top_p, block: the selection the report measures recall and density for, and the temperature is fitted to.
        calibrate_temperature: fit each head's temperature (module docstring, step 3) on the held-out queries;
            False leaves it at 1. mass_target: the teacher mass the calibrated selection covers on average
            (default: what the dense top-p blocks cover on the same queries).

    Returns: (weights, report); ``weights.temperature`` holds the temperatures.

    Raises: ValueError when ``mass_target`` is outside (0, 1].
    """
    if mass_target is not None and not 0.0 < mass_target <= 1.0:
        raise ValueError(f"mass_target must be in (0, 1], got {mass_target}")
    mods = attention_modules(model)
    hq, hkv, D = mods[0].num_heads, mods[0].num_kv_heads, mods[0].head_dim
    qpk = hq // hkv
    was_training = model.training
    model.eval()
    heads = _collect(model, profile, sequences, queries_per_seq, seed, progress)
    if was_training:
        model.train()
    rng = random.Random(seed)
    keys = sorted(heads)
    params: dict[tuple[int, int], tuple[nn.Parameter, nn.Parameter]] = {}
    train_idx: dict[tuple[int, int], list] = {}
    eval_idx: dict[tuple[int, int], list] = {}
    gen = torch.Generator().manual_seed(seed)
    for key in keys:
        d = heads[key]
        if init is not None and key[0] in init.q:
            slot = profile.retrieval_heads(key[0]).index(key[1])
            wq, wk = init.q[key[0]][slot].float(), init.k[key[0]][slot].float()
        else:
            wq, wk = _init_from_stats(d, dim, qpk, D)
        dev = d.k[0].device
        params[key] = (nn.Parameter(wq.clone().to(dev)), nn.Parameter(wk.clone().to(dev)))
        tr, ev = [], []
        for si, p in enumerate(d.qpos):
            perm = torch.randperm(p.numel(), generator=gen).to(p.device)
            n_ev = int(round(holdout * p.numel())) if p.numel() > 1 else 0
            ev.append((si, perm[:n_ev]))
            tr.append((si, perm[n_ev:]))
        train_idx[key] = [(si, r) for si, r in tr if r.numel()]
        eval_idx[key] = [(si, r) for si, r in ev if r.numel()] or train_idx[key]

    report = IndexerReport(steps=steps, top_p=top_p, block=block)
    kl0 = {key: _kl_on(heads[key], *[p.detach() for p in params[key]], eval_idx[key]) for key in keys}
    if keys and steps > 0:
        opt = torch.optim.Adam([p for pair in params.values() for p in pair], lr=lr)
        it = range(steps)
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, desc="distill indexer", unit="step")
        for _ in it:
            opt.zero_grad(set_to_none=True)
            loss = 0.0
            for key in keys:
                d = heads[key]
                si, rows = rng.choice(train_idx[key])
                if rows.numel() > batch_queries:
                    rows = rows[torch.randint(0, rows.numel(), (batch_queries,), generator=gen).to(rows.device)]
                wq, wk = params[key]
                lp = _student_logp(wq, wk, d.qg[si][rows], d.k[si], d.qpos[si][rows])
                loss = loss + _kl(d.teacher[si][rows], lp)
            loss.backward()
            opt.step()
            if progress and hasattr(it, "set_postfix"):
                it.set_postfix(kl=float(loss) / len(keys))

    temps = {}
    for key in keys:
        wq, wk = (p.detach() for p in params[key])
        with torch.no_grad():
            ev = _EvalSet(heads[key], wq, wk, eval_idx[key], block, top_p)
            target = ev.dense_mass() if mass_target is None else mass_target
            temps[key] = fit_temperature(ev, target) if calibrate_temperature else 1.0
            rec, mass, dens = ev.at(temps[key])
            _, mass1, dens1 = ev.at(1.0)
            report.heads.append(HeadReport(key[0], key[1], rec, mass, dens, kl0[key],
                                           _kl_on(heads[key], wq, wk, eval_idx[key]), dense_density=ev.dense_density(),
                                           temperature=temps[key], density_t1=dens1, mass_t1=mass1))
    out = IndexerWeights()
    for layer in sorted({l for l, _ in keys}):
        hs = profile.retrieval_heads(layer)
        out.q[layer] = torch.stack([params[(layer, h)][0].detach().float().cpu() for h in hs])
        out.k[layer] = torch.stack([params[(layer, h)][1].detach().float().cpu() for h in hs])
        out.temperature[layer] = torch.tensor([temps[(layer, h)] for h in hs], dtype=torch.float32)
    return out, report


def indexer_from_model(model: nn.Module) -> tuple[HeadProfile, IndexerWeights]:
    """The profile and indexer weights held by a model's :class:`RTPurboAttention` backends."""
    backends = rtpurbo_backends(model)
    hkv = backends[0].shape.num_kv_heads
    ret = torch.zeros(len(backends), hkv, dtype=torch.bool)
    w = IndexerWeights()
    for l, b in enumerate(backends):
        ret[l, list(b.retrieval_heads)] = True
        if b.num_retrieval:
            w.q[l] = b.indexer_q.detach().float().cpu()
            w.k[l] = b.indexer_k.detach().float().cpu()
            w.temperature[l] = b.temperature
    return HeadProfile(ret.float(), ret), w


def refresh_indexer(model: nn.Module, sequences: Sequence, *, steps: int = 20, lr: float = 1e-3,
                    queries_per_seq: int = 128, seed: int = 0, progress: bool = False) -> IndexerReport:
    """A few distillation steps on a model with RTPurbo backends, in place, from its current indexer.

    For RL: as the policy drifts, the rollout model's indexer is re-fitted to its current attention
    (call every N training steps on a few of the latest rollouts' token sequences), and its temperatures
    re-calibrated at the backends' configured ``top_p`` and decode block.
    """
    profile, current = indexer_from_model(model)
    c = rtpurbo_backends(model)[0].config
    weights, report = fit_indexer(model, profile, sequences, steps=steps, dim=current.dim or 16, lr=lr,
                                  queries_per_seq=queries_per_seq, init=current, top_p=c.top_p,
                                  block=c.decode_block, seed=seed, progress=progress)
    apply_indexer(model, weights)
    return report


def apply_indexer(model: nn.Module, indexer: IndexerWeights) -> None:
    """Copy ``indexer`` (weights and temperatures) into the model's RTPurbo backends, in place."""
    for l, m in enumerate(attention_modules(model)):
        b = m.backend
        if isinstance(b, RTPurboAttention) and b.num_retrieval:
            b.load_indexer(indexer.q[l].to(b.indexer_q), indexer.k[l].to(b.indexer_k), indexer.temperature.get(l))

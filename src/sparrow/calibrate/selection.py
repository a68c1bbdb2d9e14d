"""How sparse the selection is against how sparse the attention is: the dense attention's own top-p set beside the
indexer's, per retrieval head, with the recall of the first by the second.

For every retrieval kv head (its query group's attention averaged, as the indexer predicts it) and query, three
granularities, each a top-p set of the dense attention (what an oracle would keep) and of the indexer's scores
(divided by the head's temperature; what RTPurbo keeps), no forced blocks in either:

* **token** — the fewest keys holding ``top_p`` of the query's attention; density: keys / causal keys.
* **block** (decode) — the fewest ``block``-token key blocks holding ``top_p`` of the block masses (the indexer's
  block score is the logsumexp of its scores, the decode kernel's); density: blocks / causal blocks.
* **prefill** — per ``prefill_block`` queries, the fewest ``prefill_block`` key blocks holding ``top_p`` of the
  block masses averaged over those queries (the prefill kernel's rule); density: blocks / causal blocks.

Recall at each granularity: the attention mass in (indexer set ∩ dense set) over the attention mass of the dense
set — the share of what the oracle would read that RTPurbo reads; ``block_recall`` is its block count instead.

Token and block statistics run over each sequence's queries (or its last ``last`` positions: the question and
answer region, what decode steps see); prefill statistics over every query block of the sequence read as a prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.attention.rtpurbo import HeadProfile, IndexerWeights
from sparrow.calibrate.capture import capture_attention
from sparrow.calibrate.indexer import _tokens, mean_over
from sparrow.kernels.topp.reference import topp_mask_reference

STATS = ("dense_token", "indexer_token", "recall_token", "dense_block", "indexer_block", "recall_block",
         "block_recall", "dense_prefill", "indexer_prefill", "recall_prefill")


@dataclass
class HeadSelection:
    """One retrieval head: densities of the dense top-p set and the indexer's, and recalls (module docstring).
    ``queries``: token / block statistics' query count; ``query_blocks``: prefill statistics' count."""

    layer: int
    kv_head: int
    temperature: float
    queries: int = 0
    query_blocks: int = 0
    dense_token: float = float("nan")
    indexer_token: float = float("nan")
    recall_token: float = float("nan")
    dense_block: float = float("nan")
    indexer_block: float = float("nan")
    recall_block: float = float("nan")
    block_recall: float = float("nan")
    dense_prefill: float = float("nan")
    indexer_prefill: float = float("nan")
    recall_prefill: float = float("nan")


@dataclass
class SelectionReport:
    """:func:`measure_selection`'s result; means are over heads (each head weighs the same)."""

    heads: list[HeadSelection] = field(default_factory=list)
    top_p: float = 0.9
    block: int = 64
    prefill_block: int = 128
    last: int | None = None

    def mean(self, name: str) -> float:
        return mean_over(self.heads, name, skip_nan=True)

    def summary(self) -> dict:
        return {"top_p": self.top_p, "block": self.block, "prefill_block": self.prefill_block, "last": self.last,
                "num_heads": len(self.heads), **{k: self.mean(k) for k in ("temperature",) + STATS}}

    def table(self) -> str:
        head = (f"{'layer':>5} {'kv':>3} {'T':>5} | {'token: dense':>12} {'idx':>5} {'rec':>5} | {'block: dense':>12} "
                f"{'idx':>5} {'rec':>5} | {'prefill: dense':>14} {'idx':>5} {'rec':>5}")
        fmt = "{:>5} {:>3} {:5.2f} | {:12.3f} {:5.3f} {:5.3f} | {:12.3f} {:5.3f} {:5.3f} | {:14.3f} {:5.3f} {:5.3f}"
        cols = ("dense_token", "indexer_token", "recall_token", "dense_block", "indexer_block", "recall_block",
                "dense_prefill", "indexer_prefill", "recall_prefill")
        rows = [head] + [fmt.format(h.layer, h.kv_head, h.temperature, *(getattr(h, c) for c in cols))
                         for h in self.heads]
        rows.append(fmt.format("mean", "", self.mean("temperature"), *(self.mean(c) for c in cols)))
        return "\n".join(rows)


def _pool(x: torch.Tensor, block: int, *, fill: float = 0.0) -> torch.Tensor:
    """[..., S] -> [..., ceil(S / block), block] (padded with ``fill``)."""
    S = x.shape[-1]
    nb = -(-S // block)
    return F.pad(x, (0, nb * block - S), value=fill).unflatten(-1, (nb, block))


def _topp(logmass: torch.Tensor, valid: torch.Tensor, top_p: float) -> torch.Tensor:
    return topp_mask_reference(logmass.masked_fill(~valid, float("-inf")), valid, top_p)


class _Sums:
    """Running sums of one head's statistics."""

    def __init__(self) -> None:
        self.s = dict.fromkeys(STATS, 0.0)
        self.n = self.nb = 0

    def add(self, key: str, values: torch.Tensor) -> None:
        self.s[key] += float(values.double().sum())


def _decode_stats(acc: _Sums, teacher: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor, top_p: float,
                  block: int) -> None:
    """Token and block statistics of queries at ``pos`` [n]: teacher [n, S] probabilities, scores [n, S] (causal
    entries finite, the rest -inf)."""
    S = teacher.shape[-1]
    j = torch.arange(S, device=teacher.device)
    valid = j[None, :] <= pos[:, None]
    dense = _topp(teacher.clamp_min(1e-30).log(), valid, top_p)
    idx = _topp(scores, valid, top_p)
    acc.add("dense_token", dense.sum(-1) / (pos + 1))
    acc.add("indexer_token", idx.sum(-1) / (pos + 1))
    acc.add("recall_token", (teacher * (dense & idx)).sum(-1) / (teacher * dense).sum(-1).clamp_min(1e-30))
    bmass = _pool(teacher, block).sum(-1)  # [n, NB]
    bscore = _pool(scores, block, fill=float("-inf")).logsumexp(-1)
    bvalid = torch.arange(bmass.shape[-1], device=teacher.device)[None, :] <= (pos // block)[:, None]
    dense_b, idx_b = _topp(bmass.clamp_min(1e-30).log(), bvalid, top_p), _topp(bscore, bvalid, top_p)
    causal = (pos // block + 1).double()
    acc.add("dense_block", dense_b.sum(-1) / causal)
    acc.add("indexer_block", idx_b.sum(-1) / causal)
    acc.add("recall_block", (bmass * (dense_b & idx_b)).sum(-1) / (bmass * dense_b).sum(-1).clamp_min(1e-30))
    acc.add("block_recall", (dense_b & idx_b).sum(-1) / dense_b.sum(-1).clamp_min(1))
    acc.n += pos.numel()


def _prefill_stats(acc: _Sums, teacher: torch.Tensor, student: torch.Tensor, q0: int, top_p: float,
                   block: int) -> None:
    """Prefill statistics of the query blocks of rows ``q0 .. q0 + n`` (``q0`` and ``n`` multiples of ``block``,
    except a last short block): teacher / student [n, S] probabilities."""
    qb0 = q0 // block
    t = _pool(_pool(teacher, block).sum(-1).transpose(0, 1), block).mean(-1).transpose(0, 1)  # [nqb, NB]
    s = _pool(_pool(student, block).sum(-1).transpose(0, 1), block).mean(-1).transpose(0, 1)
    n_real = teacher.shape[0]
    if n_real % block:  # the last block's mean over its real queries only (the pad rows are zeros)
        t[-1] *= block / (n_real % block)
        s[-1] *= block / (n_real % block)
    qb = qb0 + torch.arange(t.shape[0], device=t.device)
    valid = torch.arange(t.shape[1], device=t.device)[None, :] <= qb[:, None]
    dense, idx = _topp(t.clamp_min(1e-30).log(), valid, top_p), _topp(s.clamp_min(1e-30).log(), valid, top_p)
    causal = (qb + 1).double()
    acc.add("dense_prefill", dense.sum(-1) / causal)
    acc.add("indexer_prefill", idx.sum(-1) / causal)
    acc.add("recall_prefill", (t * (dense & idx)).sum(-1) / (t * dense).sum(-1).clamp_min(1e-30))
    acc.nb += t.shape[0]


@torch.no_grad()
def measure_selection(model: nn.Module, profile: HeadProfile, indexer: IndexerWeights, sequences: Sequence, *,
                      top_p: float = 0.9, block: int = 64, prefill_block: int = 128, last: int | None = None,
                      chunk: int = 512) -> SelectionReport:
    """Densities and recalls of the dense top-p set and the indexer's (module docstring) on ``sequences``.

    Args:
        model: a Sparrow model; its dense ``forward`` gives the attention.
        profile, indexer: the retrieval heads and their indexer (``indexer.temperature`` applied; a missing layer:
            temperature 1 — pass ``IndexerWeights(q, k)`` to measure at 1).
        sequences: token sequences (1-D tensors / lists or :class:`CalibrationSequence`), one forward each.
        top_p, block, prefill_block: the selection measured.
        last: token and block statistics over each sequence's last ``last`` positions (None: every position >= 1).
        chunk: query rows computed at once (memory ``~6 * chunk * S`` floats per head), rounded down to a multiple
            of ``prefill_block``.

    Raises: ValueError on ``top_p`` outside (0, 1], a non-positive block, ``chunk < prefill_block``, ``last < 1``,
    or an indexer without weights for a layer that has retrieval heads.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if block < 1 or prefill_block < 1 or chunk < prefill_block:
        raise ValueError(f"need block, prefill_block >= 1 and chunk >= prefill_block, got {block}, {prefill_block}, "
                         f"{chunk}")
    if last is not None and last < 1:
        raise ValueError(f"last must be >= 1 or None, got {last}")
    chunk -= chunk % prefill_block
    heads = [(l, h) for l in range(profile.num_layers) for h in profile.retrieval_heads(l)]
    for l in {l for l, _ in heads}:
        if l not in indexer.q or l not in indexer.k:
            raise ValueError(f"the indexer has no weights for layer {l}, which has retrieval heads")
    acc = {key: _Sums() for key in heads}
    temps = {(l, h): 1.0 if indexer.temperature.get(l) is None else float(indexer.temperature[l][slot])
             for l in {l for l, _ in heads} for slot, h in enumerate(profile.retrieval_heads(l))}

    def cb(layer: int, t: dict[str, torch.Tensor]) -> None:
        q, k = t["q"][0].float(), t["k"][0].float()  # [Hq, S, D], [Hkv, S, D]
        q_pre, k_pre = t["q_pre"][0].float(), t["k_pre"][0].float()
        hq, S, D = q.shape
        qpk = hq // k.shape[0]
        j = torch.arange(S, device=q.device)
        queries = torch.arange(max(1, S - last) if last else 1, S, device=q.device)
        for slot, h in enumerate(profile.retrieval_heads(layer)):
            wq, wk = indexer.q[layer][slot].to(q), indexer.k[layer][slot].to(q)
            temp = temps[(layer, h)]
            grp = slice(h * qpk, (h + 1) * qpk)
            qg = q_pre[grp].permute(1, 0, 2).reshape(S, qpk * D)
            ik = k_pre[h] @ wk  # [S, r]
            for r0 in range(0, S, chunk):
                rows = torch.arange(r0, min(S, r0 + chunk), device=q.device)
                causal = j[None, :] <= rows[:, None]
                logits = torch.einsum("gid,jd->gij", q[grp, r0:r0 + rows.numel()], k[h]) / math.sqrt(D)
                teacher = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(0)  # [n, S]
                scores = ((qg[rows] @ wq) @ ik.T / temp).masked_fill(~causal, float("-inf"))
                _prefill_stats(acc[(layer, h)], teacher, torch.softmax(scores, -1), r0, top_p, prefill_block)
                sel = (rows >= queries[0]) if queries.numel() else torch.zeros_like(rows, dtype=torch.bool)
                if sel.any():
                    _decode_stats(acc[(layer, h)], teacher[sel], scores[sel], rows[sel], top_p, block)

    device = next(model.parameters()).device
    with capture_attention(model, cb, layers={l for l, _ in heads}):
        for s in sequences:
            model(_tokens(s)[None].to(device))
    report = SelectionReport(top_p=top_p, block=block, prefill_block=prefill_block, last=last)
    for (l, h), a in acc.items():
        hs = HeadSelection(l, h, temps[(l, h)], queries=a.n, query_blocks=a.nb)
        for f in fields(HeadSelection):
            if f.name in STATS:
                n = a.nb if f.name.endswith("prefill") else a.n
                setattr(hs, f.name, a.s[f.name] / n if n else float("nan"))
        report.heads.append(hs)
    return report

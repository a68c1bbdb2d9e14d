"""Retrieval-head profiling: which kv heads copy from far back in the context.

A calibration sequence is random tokens with one span repeated: once near the start, once at the end.
A head that retrieves puts attention mass, from the second copy's queries, on the first copy; a local head
does not (the first copy is far outside any window). The score of a kv head is that mass, averaged over
the second copy's queries and the head's query group; the top ``ratio`` of (layer, kv head) pairs of the
whole model become retrieval heads. :func:`ablation_scores` scores a head instead by what the model loses
(the change of its predictions) when that head alone keeps only sinks + a window.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.attention.rtpurbo import HeadProfile
from sparrow.calibrate.capture import capture_attention, local_head
from sparrow.models.attention import attention_modules


class CalibrationSequence(NamedTuple):
    """tokens: [S] int64, with ``tokens[first:first+span] == tokens[second:second+span]``."""

    tokens: torch.Tensor
    first: int
    second: int
    span: int


def repeat_span_sequences(n: int, length: int, vocab_size: int, *, span: int | None = None, offset: int = 8,
                          seed: int = 0) -> list[CalibrationSequence]:
    """``n`` random sequences of ``length`` tokens whose span at ``offset`` is repeated at the end.

    ``span`` defaults to ``max(8, length // 32)``.
    """
    span = span or max(8, length // 32)
    if offset + 2 * span > length:
        raise ValueError(f"length {length} is too short for two spans of {span} after offset {offset}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab_size, (length,), generator=g)
        second = length - span
        t[second:] = t[offset:offset + span]
        out.append(CalibrationSequence(t, offset, second, span))
    return out


def _as_calibration(seqs: Sequence) -> list[CalibrationSequence]:
    out = []
    for s in seqs:
        if isinstance(s, CalibrationSequence):
            out.append(s)
        else:
            raise TypeError("profile_heads needs CalibrationSequence items (see repeat_span_sequences)")
    return out


@torch.no_grad()
def head_scores(model: nn.Module, sequences: Sequence[CalibrationSequence], *, progress: bool = False) -> torch.Tensor:
    """[num_layers, num_kv_heads] float32: mean attention mass from each second copy onto its first copy."""
    seqs = _as_calibration(sequences)
    mods = attention_modules(model)
    L, hkv = len(mods), mods[0].num_kv_heads
    total = torch.zeros(L, hkv, dtype=torch.float64)
    device = next(model.parameters()).device
    current: dict = {}

    def cb(layer: int, t: dict[str, torch.Tensor]) -> None:
        s = current["seq"]
        q, k = t["q"][0].float(), t["k"][0].float()  # [Hq, S, D], [Hkv, S, D]
        hq, S, D = q.shape
        qpk = hq // k.shape[0]
        i = torch.arange(s.second, s.second + s.span, device=q.device)
        kk = k.repeat_interleave(qpk, 0)  # [Hq, S, D]
        logits = torch.einsum("hid,hjd->hij", q[:, i], kk) / math.sqrt(D)
        j = torch.arange(S, device=q.device)
        logits = logits.masked_fill(j[None, None, :] > i[None, :, None], float("-inf"))
        p = torch.softmax(logits, -1)
        mass = p[..., s.first:s.first + s.span].sum(-1).mean(-1)  # [Hq]
        total[layer] += mass.view(-1, qpk).mean(-1).double().cpu()

    it = seqs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(seqs, desc="profile heads", unit="seq")
    with capture_attention(model, cb):
        for s in it:
            current["seq"] = s
            model(s.tokens[None].to(device))
    return (total / max(len(seqs), 1)).float()


@torch.no_grad()
def ablation_scores(model: nn.Module, sequences: Sequence[CalibrationSequence], *, window: int, sinks: int = 4,
                    progress: bool = False) -> torch.Tensor:
    """[num_layers, num_kv_heads] float32: how much the model's predictions change when one kv head loses
    full attention. For every (layer, kv head), that head alone attends only to ``sinks`` + the last
    ``window`` positions (a non-retrieval head), and the score is the forward KL divergence from the dense
    model's next-token distributions to the changed ones, averaged over each sequence's second-copy span —
    the tokens a retrieval has to fetch from far back. It measures what the selection is for (the output
    where retrieval matters), where :func:`head_scores` measures where attention looks: on a small model
    trained on retrieval tasks the two disagree, and the heads that look do not always carry what they read.
    Costs one forward per (sequence, kv head)."""
    seqs = _as_calibration(sequences)
    mods = attention_modules(model)
    L, hkv = len(mods), mods[0].num_kv_heads
    device = next(model.parameters()).device

    def span_logp() -> list[torch.Tensor]:
        out = []
        for s in seqs:
            logits = model(s.tokens[None].to(device))[0].float()  # [S, V]
            pos = torch.arange(s.second - 1, s.second + s.span - 1, device=device)  # predicting the span
            out.append(torch.log_softmax(logits[pos], -1))
        return out

    dense = span_logp()
    scores = torch.zeros(L, hkv)
    pairs = [(layer, h) for layer in range(L) for h in range(hkv)]
    if progress:
        from tqdm.auto import tqdm

        pairs = tqdm(pairs, desc="ablate heads", unit="head")
    for layer, h in pairs:
        with local_head(model, layer, h, window=window, sinks=sinks):
            kl = [F.kl_div(a, d, log_target=True, reduction="batchmean") for a, d in zip(span_logp(), dense)]
        scores[layer, h] = float(torch.stack(kl).mean())
    return scores


def profile_heads(model: nn.Module, sequences: Sequence[CalibrationSequence], ratio: float = 0.15, *,
                  progress: bool = False) -> HeadProfile:
    """Score every (layer, kv head) on ``sequences`` and mark the top ``ratio`` as retrieval heads."""
    scores = head_scores(model, sequences, progress=progress)
    seqs = _as_calibration(sequences)
    return HeadProfile.from_scores(scores, ratio, meta={
        "method": "repeated-span attention mass", "num_sequences": len(seqs),
        "seq_len": int(seqs[0].tokens.numel()) if seqs else 0, "span": seqs[0].span if seqs else 0,
    })

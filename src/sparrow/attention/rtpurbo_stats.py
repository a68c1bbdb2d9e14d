"""RTPurbo selection statistics: how many of the visible tokens (decode) or causal key blocks (prefill) the
sparse attention kept. Eager diagnostics: recording reads device values back (host syncs), so a backend
records only after :meth:`~sparrow.attention.rtpurbo.RTPurboAttention.enable_stats`, outside compiled or
graphed steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch

from sparrow.attention.base import DecodeMeta


@dataclass
class SelectionStats:
    """Running totals of one layer (or, summed, of a model). Counts are float64 sums over calls.

    Attributes:
        decode_ret_kept / decode_ret_visible: tokens the retrieval heads read / could see, summed over
            (row, retrieval head, new token).
        decode_loc_kept / decode_loc_visible: the same for the local heads (sinks + window).
        decode_queries: new tokens decoded (row x token).
        prefill_ret_kept_blocks / prefill_ret_causal_blocks: key blocks the retrieval heads kept / the causal
            ones, summed over (prompt, retrieval head, real query block).
    """

    decode_ret_kept: float = 0.0
    decode_ret_visible: float = 0.0
    decode_loc_kept: float = 0.0
    decode_loc_visible: float = 0.0
    decode_queries: float = 0.0
    prefill_ret_kept_blocks: float = 0.0
    prefill_ret_causal_blocks: float = 0.0

    def record_decode(self, selection, meta: DecodeMeta, T: int, *, block: int, num_sinks: int, window: int,
                      num_retrieval: int, num_local: int) -> None:
        """One decode call of ``T`` tokens per row. ``selection``: the kernel's retrieval selection (a bool block
        mask [A, H_ret, T, NB] from the reference, ``(ids, counts [A*H_ret*T])`` from Triton)."""
        pos = (meta.prefix_len + meta.cached_len)[:, None] + torch.arange(T, device=meta.prefix_len.device)
        visible = (pos + 1).double()  # [A, T]
        if num_retrieval:
            if isinstance(selection, tuple):
                cnt = selection[1].view(-1, num_retrieval, T).double()
            else:
                cnt = selection.sum(-1).double()  # [A, hr, T]
            last_partial = (block - 1 - pos % block).double()[:, None]
            kept = (cnt * block - last_partial).clamp(max=visible[:, None])
            self.decode_ret_kept += float(kept.sum())
            self.decode_ret_visible += float(visible.sum()) * num_retrieval
        if num_local:
            s_eff = meta.prefix_len.clamp(max=num_sinks).double()[:, None]
            kept = torch.minimum(visible, s_eff + window)
            self.decode_loc_kept += float(kept.sum()) * num_local
            self.decode_loc_visible += float(visible.sum()) * num_local
        self.decode_queries += float(visible.numel())

    def record_prefill(self, selection, prompt_len: torch.Tensor, S: int, *, block: int, num_retrieval: int) -> None:
        """One prefill of prompts padded to ``S`` tokens. ``selection``: ``(ids, counts [P*H_ret*Qb])``, or None for
        a dense prefill (every causal block kept)."""
        nb = -(-S // block)
        qb = torch.arange(nb, device=prompt_len.device)
        cnt = (qb + 1).double().expand(len(prompt_len), num_retrieval, nb) if selection is None else \
            selection[1].view(-1, num_retrieval, nb).double()  # [P, hr, Qb]
        qb = qb.to(cnt.device)
        real = (qb * block < prompt_len[:, None].to(cnt.device))[:, None, :]  # query blocks holding real tokens
        self.prefill_ret_kept_blocks += float((cnt * real).sum())
        self.prefill_ret_causal_blocks += float(((qb + 1).double()[None, None] * real).sum()) * num_retrieval

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def summarize(stats: Iterable[dict[str, float]]) -> dict[str, float]:
    """Totals of several layers' :meth:`SelectionStats.as_dict` and the derived densities: ``decode_ret_density``
    (fraction of the visible tokens a retrieval head reads per query), ``decode_density`` (over all heads,
    local ones included), ``prefill_ret_density`` (kept / causal key blocks per query block, retrieval heads);
    NaN where nothing was recorded."""
    tot = SelectionStats().as_dict()
    for st in stats:
        for k, v in st.items():
            tot[k] += v
    out: dict[str, float] = dict(tot)
    ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
    out["decode_ret_density"] = ratio(tot["decode_ret_kept"], tot["decode_ret_visible"])
    out["decode_density"] = ratio(tot["decode_ret_kept"] + tot["decode_loc_kept"],
                                  tot["decode_ret_visible"] + tot["decode_loc_visible"])
    out["prefill_ret_density"] = ratio(tot["prefill_ret_kept_blocks"], tot["prefill_ret_causal_blocks"])
    return out

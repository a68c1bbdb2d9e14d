"""The tensors RTPurbo decode attention reads: a NamedTuple the kernel package owns (no backend type in it)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SparseDecodeCache(NamedTuple):
    """One layer's sparse-decode inputs: retrieval kv heads (``H_ret``) in full, local kv heads (``H_loc``) as
    sinks + rings. Dtypes: one float dtype for K / V (the indexer keys may differ); any device.

    prefix_k, prefix_v: [P, H_ret, Lp, D]   retrieval heads' prompt KV, position ``j`` at ``j``.
    gen_k, gen_v:       [R, H_ret, Lg, D]   retrieval heads' generated KV, generated index ``g`` at ``g``.
    prefix_ik:          [P, H_ret, Lp, r]   indexer keys beside ``prefix_k``.
    gen_ik:             [R, H_ret, Lg, r]   indexer keys beside ``gen_k``.
    prefix_lk, prefix_lv: [P, H_loc, S + Wp, D]  local heads: the prompt's first ``S = num_sinks`` tokens, then a
        ring of its last ``Wp`` tokens (position ``j`` at ``S + j % Wp``).
    gen_lk, gen_lv:     [R, H_loc, Wg, D]   local heads: a ring of the row's generated tokens (``g`` at ``g % Wg``).

    ``P`` prefix slots and ``R`` generation slots are indexed by a decode call's ``prefix_slot`` / ``row_slot``.
    """

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    gen_k: torch.Tensor
    gen_v: torch.Tensor
    prefix_ik: torch.Tensor
    gen_ik: torch.Tensor
    prefix_lk: torch.Tensor
    prefix_lv: torch.Tensor
    gen_lk: torch.Tensor
    gen_lv: torch.Tensor

"""The engine's steps: free functions over an explicit :class:`StepState`, in the shape of gpt-fast's
``decode_one_token``.

* :func:`decode_step`: one token for every row of a batch;
* :func:`draft_step`: one draft token per row, from the drafter, over the target's caches;
* :func:`verify_step`: the target over ``[last token, d_1..d_k]`` and exact rejection sampling, 1..k+1 tokens per
  row.

All three end in :func:`emit`, the one place where a decoding row's tokens, log-probs, version stamps, length and
done flag change (:func:`first_tokens` writes a freshly prefilled row's first token). They are pure device work: no
host read, no data-dependent Python branching, so :class:`~sparrow.rollout.compiler.StepCompiler` compiles them with
``fullgraph=True`` and captures them as CUDA graphs. :func:`program` strings them into what one run of a block does
(a plain step, a draft step, or a speculative *cycle*: ``k`` draft steps and a verify step), over the step functions
themselves or their compiled forms.

Names: a *step* is one of the three functions (``decode``, ``draft``, ``verify``: what is compiled, and what
``compiled_graphs`` and ``setup/compile_<step>_s`` count); a *program* is what one run replays (``decode``,
``draft`` or ``cycle``: what a block, a CUDA graph and ``RolloutEngine.time_step`` run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch
from torchtune.modules import TransformerDecoder

from sparrow.rollout.forward import decode_hidden, logits_from_hidden
from sparrow.rollout.state import DraftState, RowState
from sparrow.sampling import (SamplingParams, gumbel_noise, process_logits, row_keys, sample_from_logprobs,
                              vocab_argmax)
from sparrow.speculative.base import Drafter, ProgramKind
from sparrow.speculative.rejection import DRAFT_SALT, accept_counter_based

StepName = Literal["decode", "draft", "verify"]
STOP_SLOTS = 8  # stop-id buffer entries; a mode's compiled steps and graphs are shared by all stop sets that fit


def is_stop(tokens: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Whether each of ``tokens`` (any shape, int64) is one of ``stop_ids`` [S] (padded with -1): one broadcast
    compare, since ``torch.isin`` on CUDA may sort, which a CUDA graph cannot capture in eager mode."""
    return (tokens[..., None] == stop_ids).any(-1)


def stop_slots(n: int) -> int:
    """Entries of the stop-id buffer for ``n`` stop ids: :data:`STOP_SLOTS`, or the next power of two above."""
    slots = STOP_SLOTS
    while slots < n:
        slots *= 2
    return slots


@dataclass
class StepState:
    """Everything a step reads and writes. The tensors are allocated once and written in place, so a CUDA graph
    captured over them stays valid; ``params`` and ``stop_ids`` are the current sampling mode's (set between
    blocks, never inside a step).

    Attributes:
        model: the target, with its projections fused or not (its parameters are read, never written).
        caches: one cache per attention layer (the backends' own types), prompts and generations.
        rows: per generation slot (:class:`~sparrow.rollout.state.RowState`, the scratch row included).
        drafts: the speculative cycle's scratch (:class:`~sparrow.rollout.state.DraftState`); None without a drafter.
        drafter: proposes draft tokens over ``caches``; None without speculation.
        params: the sampling parameters whose processing (temperature, top-p, top-k, vocabulary limit, greedy)
            the steps apply; compiled steps specialise on it.
        stop_ids: [S] int64 the current stop ids, padded with -1 (``S = stop_slots(len(stop ids))``).
    """

    model: TransformerDecoder
    caches: list[Any]
    rows: RowState
    drafts: DraftState | None
    drafter: Drafter | None
    params: SamplingParams
    stop_ids: torch.Tensor


def first_tokens(s: StepState, rows: torch.Tensor, prefix_slot: torch.Tensor, prefix_len: torch.Tensor,
                 sample_id: torch.Tensor, logits: torch.Tensor) -> None:
    """Start rows ``rows`` [A] on their freshly prefilled prompts (``prefix_slot``, ``prefix_len``, noise stream
    ``sample_id``: [A] int64 each) and sample each one's first token from ``logits`` [A, V] (the prompt's last
    position), at noise counter 0."""
    r = s.rows
    r.prefix_slot[rows] = prefix_slot
    r.prefix_len[rows] = prefix_len
    r.sample_id[rows] = sample_id
    logprobs = process_logits(logits, s.params)
    tok = sample_from_logprobs(logprobs, row_keys(r.seed, sample_id, torch.zeros_like(sample_id)), s.params.greedy)
    r.tokens[rows, 0] = tok
    r.logprobs[rows, 0] = logprobs.gather(-1, tok[:, None]).squeeze(-1)
    r.versions[rows, 0] = r.policy_version
    r.n_gen[rows] = 1
    r.last_token[rows] = tok
    r.done[rows] = is_stop(tok, s.stop_ids) | (r.max_new <= 1)


def decode_step(s: StepState, row_slot: torch.Tensor) -> None:
    """One token for each row in ``row_slot`` [A] (padding rows point at the scratch slot)."""
    r = s.rows
    n_gen = r.n_gen[row_slot]  # [A] tokens emitted so far; the last one is not cached yet
    h = decode_hidden(s.model, r.last_token[row_slot][:, None], s.caches, r.meta(row_slot, n_gen - 1))
    logprobs = process_logits(logits_from_hidden(s.model, h[:, 0]), s.params)  # [A, V]
    tok = sample_from_logprobs(logprobs, row_keys(r.seed, r.sample_id[row_slot], n_gen), s.params.greedy)
    lp = logprobs.gather(-1, tok[:, None])  # [A, 1]
    emit(s, row_slot, n_gen, tok[:, None], lp, torch.zeros_like(n_gen))


def draft_step(s: StepState, row_slot: torch.Tensor) -> None:
    """One draft token for every row of ``row_slot`` [A] at draft index ``cursor``: the drafter's forward at
    position ``n_gen - 1 + cursor`` (the cursor is a device tensor, so every draft step is the same graph),
    processed like the target's logits, drawn with the draft noise stream; advances the cursor."""
    r, d = s.rows, s.drafts
    A = row_slot.shape[0]
    i = d.cursor
    n_gen = r.n_gen[row_slot]
    ar = torch.arange(A, device=row_slot.device)
    prev = d.tokens[:A].gather(1, (i - 1).clamp(min=0).view(1, 1).expand(A, 1)).squeeze(1)
    tok_in = torch.where(i == 0, r.last_token[row_slot], prev)
    logits = s.drafter.forward_logits(tok_in[:, None], s.caches, r.meta(row_slot, n_gen - 1 + i))[:, 0]
    logq = process_logits(logits, s.params)  # [A, V]
    idx = i.view(1).expand(A)
    if s.params.greedy:
        tok = vocab_argmax(logq)
    else:
        keys = row_keys(r.seed, r.sample_id[row_slot], n_gen + i)
        tok = vocab_argmax(logq + gumbel_noise(keys, logq.shape[-1], DRAFT_SALT))
        d.probs.index_put_((ar, idx), logq.exp())
    d.tokens.index_put_((ar, idx), tok)
    d.cursor.add_(1)


def verify_step(s: StepState, row_slot: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> None:
    """The target over ``[last token, d_1..d_k]`` for every row of ``row_slot`` [A] (``T = k + 1`` new tokens:
    their KV overwrites the draft's), exact rejection sampling with counter-based uniforms, then the emitted tokens
    and their target log-probs; adds to the draft counters and resets the cursor. ``draft_tokens`` [>=A, k] and
    ``draft_probs`` [>=A, k, V] are views of the draft buffers whose first ``A`` rows belong to the batch (``k`` is
    read from their shape: one compiled graph serves every draft length)."""
    r, d = s.rows, s.drafts
    A, k = row_slot.shape[0], draft_tokens.shape[1]
    n_gen = r.n_gen[row_slot]
    drafts = draft_tokens[:A]
    inputs = torch.cat([r.last_token[row_slot][:, None], drafts], dim=1)  # [A, k + 1]
    h = decode_hidden(s.model, inputs, s.caches, r.meta(row_slot, n_gen - 1))  # [A, k + 1, E]
    logp = process_logits(logits_from_hidden(s.model, h), s.params)  # [A, k + 1, V]
    keys = row_keys(r.seed, r.sample_id[row_slot], n_gen[:, None] + torch.arange(k + 1, device=row_slot.device))
    greedy = s.params.greedy
    tokens, accepted = accept_counter_based(logp, drafts, None if greedy else draft_probs[:A], keys, greedy)
    live = emit(s, row_slot, n_gen, tokens, logp.gather(-1, tokens[..., None]).squeeze(-1), accepted)
    n_live = live.long().sum()
    d.counters.add_(torch.stack([n_live * k, (accepted * live.long()).sum(), n_live]))
    d.cursor.zero_()


def emit(s: StepState, row_slot: torch.Tensor, n_gen: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
         accepted: torch.Tensor) -> torch.Tensor:
    """Emit for rows ``row_slot`` [A] the first ``accepted + 1`` [A] of ``tokens`` / ``logprobs`` [A, T] at each
    row's own offset ``n_gen`` [A], stamped with the current policy version, cut after the first stop token and at
    ``max_new``; a row that was already done emits nothing (its writes land in scratch columns nobody reads).
    Returns which rows were live [A] bool."""
    r = s.rows
    live = ~r.done[row_slot]
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    count = accepted + 1  # [A] tokens each row would emit, before the cuts
    stop = is_stop(tokens, s.stop_ids) & (pos < count[:, None])
    first_stop = torch.where(stop, pos, tokens.shape[1]).min(dim=1).values
    count = torch.minimum(torch.minimum(count, first_stop + 1), r.max_new - n_gen)
    hit_stop = first_stop < count
    count = count * live.long()
    out_idx = n_gen[:, None] + pos  # the buffers hold max_new_tokens + max_draft + 1 columns
    r.tokens[row_slot[:, None], out_idx] = tokens
    r.logprobs[row_slot[:, None], out_idx] = logprobs
    r.versions[row_slot[:, None], out_idx] = r.policy_version
    new_n = n_gen + count
    r.n_gen[row_slot] = new_n
    new_last = tokens.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
    r.last_token[row_slot] = torch.where(live, new_last, r.last_token[row_slot])
    r.done[row_slot] = ~live | hit_stop | (new_n >= r.max_new)
    return live


STEPS: Mapping[StepName, Callable[..., None]] = {"decode": decode_step, "draft": draft_step, "verify": verify_step}


def program(kind: ProgramKind, k: int, steps: Callable[[StepName], Callable[..., None]],
            s: StepState) -> Callable[[torch.Tensor], None]:
    """What one run of ``kind`` does for a slot tensor [A]: a plain step (``decode``); a draft step from index 0
    (``draft``, for calibration); or a ``cycle`` of ``k`` draft steps and a verify step over the first ``k`` draft
    columns. ``steps(name)`` gives the step functions (:data:`STEPS`) or their compiled forms, each called as
    ``step(s, row_slot, *draft_views)``; only the ones ``kind`` runs are asked for."""
    if kind == "decode":
        decode = steps("decode")
        return lambda slots: decode(s, slots)
    draft = steps("draft")
    if kind == "draft":
        def run_draft(slots: torch.Tensor) -> None:
            s.drafts.cursor.zero_()
            draft(s, slots)
        return run_draft
    verify = steps("verify")

    def run_cycle(slots: torch.Tensor) -> None:
        s.drafts.cursor.zero_()  # verify leaves it at 0, but a draft-only run leaves it at 1
        for _ in range(k):
            draft(s, slots)
        verify(s, slots, s.drafts.tokens[:, :k], s.drafts.probs[:, :k])
    return run_cycle

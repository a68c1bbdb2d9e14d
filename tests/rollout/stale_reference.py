"""A one-row generator whose weights change between tokens while the KV cache keeps what earlier weights wrote: the
oracle for rows that continue across a weight sync (partial rollout)."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from sparrow.attention import CacheSpec, DecodeMeta, PrefillMeta
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from sparrow.sampling import SamplingParams, process_logits, row_keys, sample_from_logprobs


def stale_reference(models: Mapping[int, torch.nn.Module], prompt: Sequence[int], versions: Sequence[int],
                    params: SamplingParams, *, sid: int = 0, forced: Sequence[int] | None = None):
    """Token ``i`` of one row from ``models[versions[i]]``, one token at a time through explicit caches: the prompt's
    KV comes from the model of token 0, and token ``i - 1``'s KV from the model of token ``i`` (the step that samples
    token ``i`` is the one that feeds token ``i - 1``), and nothing is recomputed when the version changes.

    Draws with the engine's counter-based noise (stream ``sid`` under ``params.seed``) until a stop token or
    ``len(versions)`` tokens; ``forced`` teacher-forces those tokens instead. Returns (tokens, logprobs)."""
    first = models[versions[0]]
    dev, dtype = next(first.parameters()).device, next(first.parameters()).dtype
    spec = CacheSpec(1, len(prompt), 1, len(versions) + 1)
    caches = [layer.attn.backend.init_cache(spec, dtype=dtype, device=dev) for layer in first.layers]
    seed, sid_t = torch.tensor(params.seed), torch.tensor([sid])
    zero, plen = torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([len(prompt)], device=dev)
    toks: list[int] = []
    lps: list[float] = []
    n = len(versions) if forced is None else len(forced)
    with torch.no_grad():
        for i in range(n):
            m = models[versions[i]]
            if i == 0:
                h = prefill_hidden(m, torch.tensor([list(prompt)], device=dev), caches, PrefillMeta(zero, plen))[:, -1]
            else:
                meta = DecodeMeta(zero, zero, plen, torch.tensor([i - 1], device=dev))
                h = decode_hidden(m, torch.tensor([[toks[-1]]], device=dev), caches, meta)[:, 0]
            logp = process_logits(logits_from_hidden(m, h), params)
            if forced is None:
                tok = int(sample_from_logprobs(logp, row_keys(seed, sid_t, torch.tensor([i])), params.greedy))
            else:
                tok = int(forced[i])
            toks.append(tok)
            lps.append(float(logp[0, tok]))
            if forced is None and tok in params.stop_token_ids:
                break
    return toks, lps

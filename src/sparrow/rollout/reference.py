"""A naive generator: recompute the whole sequence at every step (the engine's test oracle)."""

from __future__ import annotations

from typing import Sequence

import torch
from torchtune.modules import TransformerDecoder

from sparrow.rollout.results import Sample
from sparrow.sampling import SamplingParams, process_logits, row_keys, sample_from_logprobs


@torch.no_grad()
def generate_reference(
    model: TransformerDecoder, prompts: Sequence[Sequence[int]], n_samples: int, params: SamplingParams
) -> list[Sample]:
    """Same contract and noise as :meth:`RolloutEngine.generate`, one sequence at a time, no cache."""
    device = next(model.parameters()).device
    seed = torch.tensor(params.seed, dtype=torch.int64, device=device)
    stop = set(params.stop_token_ids)
    out = []
    for pi, prompt in enumerate(prompts):
        for j in range(n_samples):
            seq = torch.as_tensor(prompt, dtype=torch.int64, device=device).flatten()
            sid = torch.tensor([pi * n_samples + j], device=device)
            toks, lps, reason = [], [], "length"
            for t in range(params.max_new_tokens):
                logits = model(seq[None])[0, -1].float()
                logprobs = process_logits(logits[None], params)
                keys = row_keys(seed, sid, torch.tensor([t], device=device))
                tok = sample_from_logprobs(logprobs, keys, params.greedy)
                toks.append(int(tok))
                lps.append(float(logprobs[0, tok]))
                seq = torch.cat([seq, tok])
                if toks[-1] in stop:
                    reason = "stop"
                    break
            out.append(Sample(pi, j, torch.tensor(toks), torch.tensor(lps, dtype=torch.float32), reason))
    return out

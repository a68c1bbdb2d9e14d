"""Training-side log-probabilities of response tokens, computed in chunks.

The final hidden states of every position are computed once; the output projection, log-softmax and
gather then run over chunks of response tokens under activation checkpointing, so at most
``chunk_size x vocab`` logits exist at any time, in the forward and in the backward pass. Log-probs are taken
in the distribution the rollout engine samples from (``sampling``: vocabulary limit, temperature, top-k,
top-p), so π_θ, π_old and the behaviour policy μ are one distribution.

:func:`shared_prefix_logprobs` gives the same log-probs for a GRPO batch whose rows come in groups sharing
one prompt, computing each prompt once: a group becomes one packed sequence ``prompt | response_1 | ... |
response_G`` in which response ``j`` attends to the prompt and to itself (causally) and its positions continue
the prompt's. Every response token sees exactly the keys, values and positions it sees in its own row, so the
log-probs are those of :func:`response_logprobs`, and so are the gradients (the prompt's activations receive
the sum of what the G copies would receive). The responses of a group sit back to back: a group of G samples
of an 8K-token prompt with responses of r_1 .. r_G tokens is one sequence of 8K + sum(r) tokens instead of G
sequences of 8K + max(r).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from torchtune.modules import TransformerDecoder

from sparrow.attention.base import PrefixPackMask
from sparrow.sampling import SamplingParams, token_logprobs


def hidden_states(model: TransformerDecoder, tokens: torch.Tensor, *,
                  mask: torch.Tensor | PrefixPackMask | None = None, input_pos: torch.Tensor | None = None,
                  checkpoint_layers: bool = False) -> torch.Tensor:
    """tokens [N, S] -> final hidden states [N, S, E] (before the final norm), dense attention.

    Causal by default; ``mask`` (bool [N, S, S], True where a query may attend to a key, or a
    :class:`~sparrow.attention.PrefixPackMask`) and ``input_pos`` (int64 [N, S], the RoPE position of each token)
    describe packed sequences instead. ``checkpoint_layers`` (with gradients on): each layer keeps only its input
    for the backward pass and runs again there, so the activations held at once are one layer's instead of every
    layer's (the same values and gradients, one more forward of the layers)."""
    kw = {} if mask is None else {"mask": mask, "input_pos": input_pos}
    recompute = checkpoint_layers and torch.is_grad_enabled()
    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        h = checkpoint(layer, h, use_reentrant=False, **kw) if recompute else layer(h, **kw)
    return h


def _chunk_logprobs(model: TransformerDecoder, h: torch.Tensor, targets: torch.Tensor, sampling: SamplingParams):
    return token_logprobs(model.output(model.norm(h)), targets, sampling)


def response_logprobs(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    *,
    max_response_len: int,
    sampling: SamplingParams | None = None,
    chunk_size: int = 1024,
    checkpoint_layers: bool = False,
) -> torch.Tensor:
    """Log-probs of each response token under ``model``, in the distribution the rollout engine samples from.

    Args:
        tokens: [N, S] prompt followed by response, right-padded.
        prompt_len, response_len: [N] int64.
        max_response_len: ``L``, the width of the output.
        sampling: the behaviour policy's processing (vocabulary limit, temperature, top-k, top-p; see
            :func:`sparrow.sampling.token_logprobs`); default: the model's plain distribution.
        chunk_size: response tokens per logits chunk.
        checkpoint_layers: recompute each layer in the backward pass (:func:`hidden_states`).

    Returns: [N, L] float32; entry ``(i, j)`` is log p(token at ``prompt_len[i] + j``), zero past
    ``response_len[i]``; ``-inf`` where top-k / top-p under these weights exclude the token.
    """
    N, S = tokens.shape
    j = torch.arange(max_response_len, device=tokens.device)
    mask = j[None, :] < response_len[:, None]  # [N, L]
    pos = (prompt_len[:, None] + j[None, :]).clamp(max=S - 1)  # position of each response token
    h = hidden_states(model, tokens, checkpoint_layers=checkpoint_layers)  # [N, S, E]
    rows, cols = mask.nonzero(as_tuple=True)
    src = pos[rows, cols]
    h_sel = h[rows, src - 1]  # the hidden state that predicts the token
    tgt = tokens[rows, src]
    return _gather_logprobs(model, h_sel, tgt, rows, cols, (N, max_response_len), sampling, chunk_size)


def _gather_logprobs(model, h_sel, tgt, rows, cols, shape, sampling: SamplingParams | None,
                     chunk_size: int) -> torch.Tensor:
    """Log-probs of ``tgt`` from the hidden states ``h_sel`` [T, E], in chunks, scattered into ``shape``."""
    sampling = sampling or SamplingParams()
    out = torch.zeros(shape, dtype=torch.float32, device=h_sel.device)
    parts = []
    for s in range(0, h_sel.shape[0], chunk_size):
        hs, ts = h_sel[s:s + chunk_size], tgt[s:s + chunk_size]
        if torch.is_grad_enabled() and hs.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, model, hs, ts, sampling, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(model, hs, ts, sampling))
    if parts:
        out = out.index_put((rows, cols), torch.cat(parts))
    return out


@dataclass
class SharedPrefixPack:
    """A GRPO batch of ``n`` groups packed one group per sequence (see :func:`pack_shared_prefix`).

    tokens: [n, W] int64, ``W = P + max_g sum_j r_gj`` (``P`` the longest prompt, ``r_gj`` the response
        lengths): the group's prompt in ``[0, P)`` (positions past it are never attended to), then its
        responses back to back, without padding between them.
    input_pos: [n, W] int64, the RoPE position of each token (a response continues its prompt).
    mask: the attention pattern: the prompt region ``[0, P)`` causal (its padding queries too; nothing reads
        them), and ``mask.rest`` [n, W - P, W] bool for the queries past it, True where a query attends to a key
        (a padding query there attends to itself only).
    rows, cols: [T] int64, every response token ``(row, offset)``, row-major (``T = sum(response_len)``).
    predictor: [T] int64, the packed index (in group ``rows // G``) of the hidden state predicting it.
    targets: [T] int64, the token itself.
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    mask: PrefixPackMask
    rows: torch.Tensor
    cols: torch.Tensor
    predictor: torch.Tensor
    targets: torch.Tensor


def pack_shared_prefix(tokens: torch.Tensor, prompt_len: torch.Tensor, response_len: torch.Tensor, *,
                       group: int) -> SharedPrefixPack:
    """Pack rows ``[i * group, (i + 1) * group)`` (one prompt, ``group`` responses) into one sequence each.
    Responses sit back to back, so a long-tailed group costs its total length, not ``group`` times its longest
    response. Arguments as :func:`response_logprobs`.

    One read back from the device (the packed width, the token count and the check below).

    Raises:
        ValueError: ``N`` is not a multiple of ``group``, or the rows of a group do not share their prompt
            (length and tokens).
    """
    N, S = tokens.shape
    if group < 1 or N % group:
        raise ValueError(f"{N} rows do not split into groups of {group}")
    G, n, dev = group, N // group, tokens.device
    lead = torch.arange(n, device=dev).repeat_interleave(G) * G  # each row's group leader
    plen = prompt_len[lead[::G]]  # [n]
    inside = torch.arange(S, device=dev)[None, :] < prompt_len[lead][:, None]
    shared = ((prompt_len == prompt_len[lead]) & ((tokens == tokens[lead]) | ~inside).all(1)).all()
    r = response_len.view(n, G)
    ok, P, T, total = (int(x) for x in torch.stack(  # deliberate host sync: the check and the packed sizes
        [shared.long(), plen.max(), r.sum(1).max(), response_len.sum()]).tolist())
    if not ok:
        raise ValueError(f"rows of a group of {G} do not share their prompt: shared-prefix log-probs need the "
                         "batch prompt-major, sample j of prompt i at row i * group + j")
    W = P + T
    # every response token (row, col), row-major, without a second read back
    rows = torch.repeat_interleave(torch.arange(N, device=dev), response_len, output_size=total)
    row_start = response_len.cumsum(0) - response_len
    cols = torch.arange(total, device=dev) - row_start[rows]
    gi = rows // G
    dest = P + (r.cumsum(1) - r).view(N)[rows] + cols  # its packed index
    # per packed index: segment (-1 prompt, j response j, -2 padding), offset inside it, real token or not
    seg = torch.full((n, W), -2, dtype=torch.int64, device=dev)
    seg[:, :P] = -1
    seg[gi, dest] = rows % G
    off = torch.arange(W, device=dev).expand(n, W).clone()
    off[gi, dest] = cols
    targets = tokens[rows, prompt_len[rows] + cols]
    packed = torch.zeros((n, W), dtype=tokens.dtype, device=dev)
    packed[:, :P] = tokens[lead[::G], :P]
    packed[gi, dest] = targets
    real = torch.where(seg == -1, off < plen[:, None], seg >= 0)
    pos = torch.where(seg >= 0, plen[:, None] + off, torch.where(seg == -1, off, 0))
    # the queries past the prompt region ([n, W - P, W]): a response sees its group's real prompt tokens and
    # itself up to its own position; a padding query sees itself
    seg_q, seg_k, off_q, off_k = seg[:, P:, None], seg[:, None, :], off[:, P:, None], off[:, None, :]
    own_key = (seg_k == seg_q) & (seg_q >= 0) & (off_k <= off_q)
    prompt_key = (seg_k == -1) & (seg_q >= 0)
    itself = torch.arange(P, W, device=dev)[:, None] == torch.arange(W, device=dev)[None, :]
    mask = PrefixPackMask(P, ((prompt_key | own_key) & real[:, None, :]) | itself[None])
    # a response's first token is predicted by the prompt's last one, the others by the token before them
    predictor = torch.where(cols == 0, prompt_len[rows] - 1, dest - 1)
    return SharedPrefixPack(packed, pos, mask, rows, cols, predictor, targets)


def shared_prefix_logprobs(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    *,
    group: int,
    max_response_len: int,
    sampling: SamplingParams | None = None,
    chunk_size: int = 1024,
    checkpoint_layers: bool = False,
) -> torch.Tensor:
    """:func:`response_logprobs` for rows that come in groups of ``group`` sharing one prompt, each prompt
    computed once (module docstring). Same arguments and result ([N, L] float32).

    Raises:
        ValueError: as :func:`pack_shared_prefix`.
    """
    pack = pack_shared_prefix(tokens, prompt_len, response_len, group=group)
    h = hidden_states(model, pack.tokens, mask=pack.mask, input_pos=pack.input_pos,
                      checkpoint_layers=checkpoint_layers)  # [n, W, E]
    h_sel = h[pack.rows // group, pack.predictor]
    return _gather_logprobs(model, h_sel, pack.targets, pack.rows, pack.cols, (tokens.shape[0], max_response_len),
                            sampling, chunk_size)

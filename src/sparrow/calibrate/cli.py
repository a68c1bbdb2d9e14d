"""``sparrow calibrate``: head profile + indexer from a checkpoint, saved beside it, with a report.

Example::

    sparrow calibrate --checkpoint DIR --seq-len 8192 --steps 600

builds the model the Hugging Face directory ``DIR`` describes (``sparrow.models.from_hf``; with
``--model NAME`` the named builder instead, checked against ``config.json`` when the weights load), loads the
weights, profiles retrieval heads on one repeated-span sequence (``--profile-seqs``), fits the indexer on
``--num-seqs`` sequences and calibrates its temperature (``--no-temperature``: 1), prints per-head recall / density
beside the dense top-p set's density, and writes ``rtpurbo.json`` and
``rtpurbo_indexer.safetensors`` into ``--out`` (default: the checkpoint directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from sparrow.attention.rtpurbo import RTPurboConfig
from sparrow.attention.rtpurbo_io import save_rtpurbo
from sparrow.calibrate.indexer import fit_indexer
from sparrow.calibrate.profile import profile_heads, repeat_span_sequences

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparrow calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a builder of sparrow.models, e.g. qwen2_5_0_5b, tiny_qwen2 (default with a Hugging Face "
                        "directory: the model its config.json describes; required with a state-dict file)")
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="Hugging Face model directory, or a .safetensors / .pt state dict of the Sparrow model")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="model context (RoPE table; sets the saved window): default the builder's or the config's "
                        "max_position_embeddings, at least seq-len")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: beside the checkpoint)")
    p.add_argument("--ratio", type=float, default=0.15, help="fraction of (layer, kv head) pairs kept as retrieval heads")
    p.add_argument("--seq-len", type=int, default=4096, help="calibration sequence length")
    p.add_argument("--span", type=int, default=None, help="repeated span length (default seq-len / 32)")
    p.add_argument("--profile-seqs", type=int, default=1, help="sequences for head profiling")
    p.add_argument("--num-seqs", type=int, default=8, help="sequences for indexer distillation")
    p.add_argument("--steps", type=int, default=600, help="distillation steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--indexer-dim", type=int, default=16)
    p.add_argument("--queries-per-seq", type=int, default=256)
    p.add_argument("--top-p", type=float, default=0.9, help="selection the report measures")
    p.add_argument("--block", type=int, default=64, help="selection block the report measures")
    p.add_argument("--no-temperature", action="store_true",
                   help="leave the indexer's temperature at 1 (default: calibrated on held-out queries)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def load_model(name: str | None, checkpoint: Path, *, max_seq_len: int, device: str, dtype: torch.dtype):
    """The model to calibrate: ``from_hf(checkpoint)`` for a Hugging Face directory without ``name``; else the
    builder ``name`` of :mod:`sparrow.models` with the checkpoint loaded (an HF directory through the validated
    ``load_hf_checkpoint``, a ``.safetensors`` / ``.pt`` state dict directly)."""
    import sparrow.models as models

    if not checkpoint.exists():
        raise SystemExit(f"checkpoint {checkpoint} does not exist")
    if name is None:
        if not checkpoint.is_dir():
            raise SystemExit(f"--model is required with a state-dict checkpoint ({checkpoint}): name the "
                             "sparrow.models builder it belongs to, e.g. --model tiny_qwen2")
        model = models.from_hf(checkpoint, max_seq_len=max_seq_len)
        return model.to(device=device, dtype=dtype).eval()
    builder = getattr(models, name, None)
    if builder is None or not callable(builder):
        raise SystemExit(f"unknown model builder {name!r} (see sparrow.models)")
    model = builder(max_seq_len=max_seq_len)
    if checkpoint.is_dir():
        models.load_hf_checkpoint(model, checkpoint)
    elif checkpoint.suffix == ".safetensors":
        from safetensors.torch import load_file

        models.load_model_state(model, load_file(str(checkpoint)))
    else:
        models.load_model_state(model, torch.load(checkpoint, map_location="cpu", weights_only=True))
    return model.to(device=device, dtype=dtype).eval()


def _context(args) -> int:
    """The model context: ``--max-seq-len``, else the builder's default (an HF directory without ``--model``:
    its ``max_position_embeddings``), and never below ``--seq-len``."""
    if args.max_seq_len:
        return max(args.max_seq_len, args.seq_len)
    import inspect

    import sparrow.models as models

    if args.model is None:
        if not args.checkpoint.is_dir():
            return args.seq_len  # load_model reports the missing --model
        return max(models.read_hf_config(args.checkpoint).max_position_embeddings, args.seq_len)
    builder = getattr(models, args.model, None)
    if not callable(builder):
        return args.seq_len  # load_model reports the unknown name
    default = inspect.signature(builder).parameters.get("max_seq_len")
    base = default.default if default is not None and isinstance(default.default, int) else args.seq_len
    return max(base, args.seq_len)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = not args.no_progress
    t0 = time.perf_counter()
    model = load_model(args.model, args.checkpoint, max_seq_len=_context(args), device=args.device,
                       dtype=DTYPES[args.dtype])
    for p in model.parameters():
        p.requires_grad_(False)
    vocab = model.tok_embeddings.num_embeddings
    prof_seqs = repeat_span_sequences(args.profile_seqs, args.seq_len, vocab, span=args.span, seed=args.seed)
    profile = profile_heads(model, prof_seqs, args.ratio, progress=progress)
    ret = profile.retrieval.nonzero().tolist()
    print(f"retrieval heads ({len(ret)} of {profile.retrieval.numel()}, ratio {profile.ratio:.3f}): "
          + ", ".join(f"L{l}/kv{h}" for l, h in ret))
    fit_seqs = repeat_span_sequences(args.num_seqs, args.seq_len, vocab, span=args.span, seed=args.seed + 1)
    indexer, report = fit_indexer(model, profile, fit_seqs, steps=args.steps, dim=args.indexer_dim, lr=args.lr,
                                  queries_per_seq=args.queries_per_seq, top_p=args.top_p, block=args.block,
                                  calibrate_temperature=not args.no_temperature, seed=args.seed, progress=progress)
    print(report.table())
    out = args.out or (args.checkpoint if args.checkpoint.is_dir() else args.checkpoint.parent)
    config = RTPurboConfig.for_context(model.max_seq_len, retrieval_ratio=args.ratio, indexer_dim=args.indexer_dim,
                                       top_p=args.top_p)
    summary = dict(report.summary(), seq_len=args.seq_len, num_seqs=args.num_seqs, seconds=time.perf_counter() - t0,
                   heads=[vars(h) for h in report.heads])
    save_rtpurbo(out, profile, indexer, config=config, report=summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "heads"}, indent=None))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

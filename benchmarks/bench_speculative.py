"""Speculative rollout: autoregressive vs SD always-on vs SD + cost-model toggle + adaptive draft length.

Question: on a GRPO rollout batch with long-tailed response lengths and long prompts, how much does the
engine's speculative path (quantized self-drafter with windowed attention over the shared KV cache, exact
rejection sampling) cut rollout latency, and does the cost-model toggle keep it from ever being slower
than plain decoding at any active batch size?

Model and workload. A Qwen2.5-0.5B-shaped model (``--model 1.5b`` for 1.5B), bf16, trained *in this run*
for ``--train-seconds`` on a synthetic task, so that acceptance rates come from a trained model with peaked,
structured distributions (random weights make acceptance meaningless; ``--random`` adds a latency-only
phase on random weights first, whose acceptance figures must not be read as real). The task
(:class:`SyntheticTask`) is a stream of *episodes*: a Markov chain over a class's own tokens (8 Zipf-weighted
successors per token) ending with EOS at a class-dependent hazard, mean episode lengths log-spaced from
``--min-mean`` to ``--max-mean`` tokens over 8 classes. A rollout prompt is a stream of ``--min-prompt``..``--max-prompt`` tokens (log-uniform)
ending inside a fresh episode of a random class, so response lengths are long-tailed (capped by
``--max-new``). ``--prompts`` x ``--samples`` rows are sampled at temperature 1.

Runs (one engine; compiled steps and CUDA graphs shared): AR (toggle ``AlwaysOff``), SD with
:class:`CostModelToggle` (costs calibrated on this engine at start-up) and adaptive draft length, SD
always-on with ``--always-k`` drafts, in that order; the JSON is rewritten after every run, so a run cut
short keeps what finished, and ``--deadline-minutes`` skips the runs that would end past it. The
calibrated cost table is printed as soon as it is measured. Reported: rollout latency (prefill + decode),
decode tokens/s per batch bucket, acceptance, tokens per cycle, draft-length histogram, drafter refresh time.
Then (``--per-batch-tokens``, ``per_batch`` in the JSON) the three policies at each batch bucket held fixed:
``b`` rows decode a fixed number of tokens without a stop token, so the batch never shrinks — the direct
answer to "never slower at any active batch" (in the long-tailed rollout the AR run may never visit the
small buckets: all its long rows finish together).

Run (H200): ``python benchmarks/bench_speculative.py``; smoke run on CPU: ``python benchmarks/bench_speculative.py --quick``.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import base_parser, batch_buckets, print_table, save_figure, write_json  # noqa: E402

NAME = "speculative"
EOS = 1
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ task
class SyntheticTask:
    """Episodes of class-coloured Markov chains with a class-dependent stop hazard.

    Token ids: ``EOS = 1``; class ``c`` owns ids ``first + c * per_class .. first + (c + 1) * per_class - 1``.
    Inside an episode each token moves to one of ``successors`` tokens of its class (Zipf weights); after
    each token the episode ends (EOS) with probability ``1 / mean_len[c]``; after EOS a new episode starts
    at a uniformly random token of a uniformly random class.
    """

    def __init__(self, n_classes=8, per_class=256, successors=8, min_mean=128, max_mean=8192, first=16, seed=0,
                 device="cpu"):
        self.C, self.M, self.first, self.device = n_classes, per_class, first, device
        g = torch.Generator().manual_seed(seed)
        n = n_classes * per_class
        base = (torch.arange(n) // per_class) * per_class
        self.succ = (torch.randint(0, per_class, (n, successors), generator=g) + base[:, None]).to(device)
        w = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64) ** 1.1
        self.succ_logp = torch.log(w / w.sum()).float().to(device)
        ratio = (max_mean / min_mean) ** (1.0 / max(1, n_classes - 1))
        self.means = [min_mean * ratio**c for c in range(n_classes)]
        self.hazard = torch.tensor([1.0 / m for m in self.means], device=device)
        self.vocab_needed = first + n

    def _step(self, x: torch.Tensor, g: torch.Generator, allow_eos: bool) -> torch.Tensor:
        """x: [R] task-local ids (-1 = EOS) -> next ids."""
        R = x.shape[0]
        dev = self.device
        is_eos = x < 0
        xc = x.clamp(min=0)
        u = torch.rand(R, generator=g, device=dev)
        gumbel = -torch.log(-torch.log(torch.rand(R, self.succ.shape[1], generator=g, device=dev).clamp(1e-12, 1 - 1e-7)))
        nxt = self.succ[xc].gather(1, torch.argmax(self.succ_logp + gumbel, dim=1, keepdim=True)).squeeze(1)
        if allow_eos:
            nxt = torch.where(u < self.hazard[xc // self.M], torch.full_like(nxt, -1), nxt)
        start = torch.randint(0, self.C * self.M, (R,), generator=g, device=dev)
        return torch.where(is_eos, start, nxt)

    def streams(self, rows: int, length: int, g: torch.Generator, start_class=None, allow_eos=True) -> torch.Tensor:
        """[rows, length] vocabulary ids of task streams (a fresh episode starts at position 0)."""
        if start_class is None:
            x = torch.randint(0, self.C * self.M, (rows,), generator=g, device=self.device)
        else:
            x = start_class * self.M + torch.randint(0, self.M, (rows,), generator=g, device=self.device)
        out = torch.empty((rows, length), dtype=torch.int64, device=self.device)
        for t in range(length):
            out[:, t] = x
            x = self._step(x, g, allow_eos)
        return torch.where(out < 0, torch.full_like(out, EOS), out + self.first)

    def prompts(self, n: int, min_len: int, max_len: int, seed: int, tail: int = 24):
        """n prompts of log-uniform lengths, each ending inside a fresh episode of a random class."""
        gc_ = torch.Generator().manual_seed(seed)
        g = torch.Generator(device=self.device).manual_seed(seed)
        lens = torch.exp(torch.empty(n).uniform_(math.log(min_len), math.log(max_len), generator=gc_)).long().tolist()
        classes = torch.randint(0, self.C, (n,), generator=gc_).tolist()
        body = self.streams(n, max(lens) - tail, g).cpu()
        out = []
        for i, (L, c) in enumerate(zip(lens, classes)):
            ep = self.streams(1, tail, g, start_class=c, allow_eos=False)[0].cpu()
            out.append(torch.cat([body[i, : L - tail - 1], torch.tensor([EOS]), ep]).tolist())
        return out, classes


def train(model, task: SyntheticTask, seconds: float, seq_len: int, batch: int, lr: float, device,
          warmup: int = 50) -> dict:
    """Train ``model`` in place on task streams for ``seconds`` (AdamW, ``warmup`` steps of linear warm-up,
    cosine to 10 %)."""
    g = torch.Generator(device=device).manual_seed(1)
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]  # restored after training: compiled steps guard on them
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses, steps = [], 0
    t_start = time.perf_counter()
    pool = task.streams(batch * 64, seq_len + 1, g)  # reused in rotation with random crops
    while True:
        elapsed = time.perf_counter() - t_start
        if elapsed >= seconds and steps >= 5:
            break
        frac = min(1.0, elapsed / seconds)
        cur_lr = lr * min(1.0, (steps + 1) / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = cur_lr
        if steps % 64 == 63:
            pool = task.streams(batch * 64, seq_len + 1, g)
        idx = torch.randint(0, pool.shape[0], (batch,), generator=g, device=device)
        seq = pool[idx]
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            enabled=torch.device(device).type == "cuda"):
            logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        steps += 1
        if steps % 25 == 0 or steps == 1:
            losses.append((steps, loss.item()))
            log(f"  train step {steps}: loss {losses[-1][1]:.3f} (lr {cur_lr:.2e})")
    for p, f in zip(params, flags):
        p.requires_grad_(f)
        p.grad = None
    del opt
    model.eval()
    sync()
    return {"steps": steps, "seconds": time.perf_counter() - t_start, "tokens": steps * batch * seq_len,
            "loss_curve": losses, "final_loss": loss.item()}


def task_entropy(task: SyntheticTask) -> float:
    """Mean next-token entropy (nats) inside an episode, ignoring the rare EOS: the loss floor."""
    p = task.succ_logp.exp()
    return float(-(p * task.succ_logp).sum())


# ----------------------------------------------------------------------------------------- model
def build_model(args, device, dtype):
    import sparrow.models as sm

    max_len = args.max_prompt + args.max_new + args.max_draft + 8
    torch.manual_seed(0)
    if args.quick:
        model = sm.qwen2(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                         intermediate_dim=128, max_seq_len=max_len, tie_word_embeddings=True)
    elif args.model == "1.5b":
        model = sm.qwen2_5_1_5b(max_seq_len=max_len)
    else:
        model = sm.qwen2_5_0_5b(max_seq_len=max_len)
    for name, p in model.named_parameters():
        if name.endswith("scale"):  # RMSNorm gains
            torch.nn.init.ones_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    return model.to(device=device, dtype=dtype).eval()


def summarize(name: str, gen, prefill_s: float, decode_s: float) -> dict:
    st = gen.stats
    lengths = sorted(s.length for s in gen)
    return {
        "run": name, "latency_s": prefill_s + decode_s, "prefill_s": prefill_s, "decode_s": decode_s,
        "tokens": st.generated_tokens, "decode_tok_s": st.generated_tokens / decode_s if decode_s else 0.0,
        "acceptance": st.acceptance_rate if st.draft_proposed else None,
        "tokens_per_cycle": st.tokens_per_cycle if st.spec_row_cycles else None,
        "spec_cycles": st.spec_cycles, "steps": st.decode_steps,
        "draft_len_hist": dict(sorted(st.draft_len_hist.items())),
        "len_p50": lengths[len(lengths) // 2], "len_p90": lengths[int(0.9 * (len(lengths) - 1))], "len_max": lengths[-1],
        "stop_frac": sum(s.finish_reason == "stop" for s in gen) / len(gen),
        "bucket_tok_s": {b: st.block_tokens[b] / st.block_time_s[b] for b in sorted(st.block_tokens) if st.block_time_s[b] > 0},
        "bucket_steps": dict(sorted(st.active_hist.items())),
        "bucket_spec_steps": dict(sorted(st.spec_hist.items())),
    }


def run_phase(label, engine, prompts, params, args, costs, save=None, deadline=None):
    """AR, SD + cost-model toggle + adaptive length, SD always-on (in that order: the headline pair first).
    ``save(rows)`` runs after each run (partial results survive a kill); a run is skipped once the time
    already spent on AR would carry it past ``deadline`` (``time.perf_counter()`` seconds)."""
    from sparrow.speculative import CostModelToggle

    out = []
    for name, toggle in toggles(args, costs):
        if out and deadline is not None and time.perf_counter() + out[0]["latency_s"] > deadline:
            log(f"  {label} / {name}: skipped (deadline)")
            continue
        engine.toggle = toggle
        gc.collect()
        sync()
        t0 = time.perf_counter()
        gen = engine.generate(prompts, args.samples, params)
        sync()
        total = time.perf_counter() - t0
        row = summarize(name, gen, gen.stats.prefill_s, total - gen.stats.prefill_s)
        row["phase"] = label
        if isinstance(toggle, CostModelToggle):
            row["final_alpha_estimate"] = toggle.adaptive.alpha
        out.append(row)
        ar = out[0]["latency_s"]
        for r in out:
            r["speedup_vs_ar"] = ar / r["latency_s"]
            r["latency_reduction"] = 1.0 - r["latency_s"] / ar
        if save is not None:
            save(out)
        log(f"  {label} / {name}: latency {row['latency_s']:.2f}s (prefill {row['prefill_s']:.2f}s), "
            f"{row['tokens']} tokens, acceptance {row['acceptance']}, tokens/cycle {row['tokens_per_cycle']}, "
            f"draft lengths {row['draft_len_hist']}, lengths p50/p90/max {row['len_p50']}/{row['len_p90']}/{row['len_max']}")
    return out


def toggles(args, costs):
    """The three decoding policies compared: (name, toggle), a fresh toggle each time."""
    from sparrow.speculative import AdaptiveDraft, AlwaysOff, AlwaysOn, CostModelToggle

    return [
        ("AR", AlwaysOff()),
        ("SD toggle+adaptive", CostModelToggle(costs, margin=args.margin, hysteresis=args.hysteresis,
                                               adaptive=AdaptiveDraft(lengths=tuple(args.lengths), prior=args.prior),
                                               probe_every=args.probe_every)),
        (f"SD always k={args.always_k}", AlwaysOn(args.always_k)),
    ]


def per_batch_phase(engine, prompts, args, costs, deadline=None) -> list[dict]:
    """Decode speed at a fixed active batch: for each engine bucket ``b``, ``b`` rows (``b // samples``
    prompts x ``samples``, or one prompt x ``b``) decode exactly ``--per-batch-tokens`` tokens each (no stop
    token, so the batch never shrinks), under each policy. The long-tailed rollout mixes batch sizes; this
    isolates them: the toggle should never be slower than AR at any batch size."""
    from sparrow.rollout import SamplingParams

    new_tokens = min(args.per_batch_tokens, args.max_new)
    out = []
    for b in engine.config.buckets:
        if deadline is not None and time.perf_counter() > deadline:
            log(f"  per-batch {b}: skipped (deadline)")
            continue
        n_s = min(b, args.samples)
        n_p = b // n_s
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=(), seed=1)
        row = {"batch": b, "prompts": n_p, "samples": n_s, "new_tokens": new_tokens}
        for name, toggle in toggles(args, costs):
            engine.toggle = toggle
            graphs = _graph_count(engine)
            sync()
            t0 = time.perf_counter()
            gen = engine.generate(prompts[:n_p], n_s, params)
            sync()
            decode_s = time.perf_counter() - t0 - gen.stats.prefill_s
            # the stop-free params share the rollout's mode (padded stop ids): nothing may compile in here
            row[f"{name} compiled"] = _graph_count(engine) - graphs
            row[f"{name} tok/s"] = gen.stats.generated_tokens / decode_s
            if name != "AR":
                row[f"{name} /AR"] = row[f"{name} tok/s"] / row["AR tok/s"]
                row[f"{name} acceptance"] = gen.stats.acceptance_rate if gen.stats.draft_proposed else None
        out.append(row)
        log(f"  per-batch {b}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                             if k.endswith("/AR") and v is not None))
    return out


def _graph_count(engine) -> int:
    """Sampling modes the engine has compiled for (a new mode compiles its steps anew) plus the CUDA graphs of
    every mode (plain decode steps and speculative cycles)."""
    return engine.sampling_modes + engine.captured_graphs


def bucket_table(rows: list[dict]) -> list[dict]:
    buckets = sorted({b for r in rows for b in r["bucket_tok_s"]})
    tog = next((r for r in rows if r["run"].startswith("SD toggle")), None)
    table = []
    for b in buckets:
        t = {"bucket": b}
        ar = rows[0]["bucket_tok_s"].get(b)
        for r in rows:
            v = r["bucket_tok_s"].get(b)
            t[r["run"]] = v
            if r is not rows[0]:
                t[r["run"] + " /AR"] = v / ar if v is not None and ar else None
        steps = tog["bucket_steps"].get(b, 0) if tog else 0
        t["toggle SD frac"] = tog["bucket_spec_steps"].get(b, 0) / steps if steps else None
        table.append(t)
    return table


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--model", choices=["0.5b", "1.5b"], default="0.5b")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=2048)
    p.add_argument("--max-prompt", type=int, default=32768)
    p.add_argument("--max-new", type=int, default=8192)
    p.add_argument("--max-draft", type=int, default=8)
    p.add_argument("--min-mean", type=float, default=128, help="mean response length of the shortest class")
    p.add_argument("--max-mean", type=float, default=8192, help="mean response length of the longest class")
    p.add_argument("--lengths", type=int, nargs="+", default=[2, 4, 8], help="adaptive draft-length ladder")
    p.add_argument("--always-k", type=int, default=4)
    p.add_argument("--weight", choices=["int8", "int4", "fp8", "none"], default="int8")
    p.add_argument("--window", type=int, default=1024, help="draft attention window (0: full attention)")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--per-batch-tokens", type=int, default=512,
                   help="after the rollouts, decode this many tokens per row at each fixed batch size (0: skip)")
    p.add_argument("--probe-every", type=int, default=8,
                   help="cost-model toggle: while off, speculate one block in this many to re-measure acceptance")
    p.add_argument("--hysteresis", type=float, default=0.03)
    p.add_argument("--prior", type=float, default=0.8, help="acceptance assumed before any is measured")
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--bucket-growth", type=int, choices=[2, 4], default=2,
                   help="batch buckets are powers of this (4: half the CUDA graphs to compile and capture)")
    p.add_argument("--train-seconds", type=float, default=60.0)
    p.add_argument("--train-seq", type=int, default=2048, help="training sequence length (the chain is local)")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (1e-3 stalled a 0.5B model "
                   "at loss ~7.3 against a floor of 1.76)")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--deadline-minutes", type=float, default=None,
                   help="from the start: skip runs that would end past it (each finished run is saved at once)")
    p.add_argument("--random", action="store_true", help="also run a latency-only phase on random weights first")
    p.add_argument("--calib-steps", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="compile the steps off CUDA too (a slow smoke test)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.quick:
        args.prompts, args.samples = 4, 2
        args.min_prompt, args.max_prompt, args.max_new = 48, 192, 96
        args.train_seconds, args.train_seq, args.train_batch = 6.0, 256, 4
        args.window, args.max_draft, args.lengths, args.always_k = 32, 4, [2, 4], 3
        args.sync_every, args.calib_steps, args.lr, args.warmup_steps = 4, 2, 3e-3, 5
        torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32

    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
    from sparrow.speculative import CostModel, DrafterConfig, QuantizedSelfDrafter

    task = SyntheticTask(**(dict(n_classes=4, per_class=32, min_mean=8, max_mean=64) if args.quick else
                            dict(min_mean=args.min_mean, max_mean=args.max_mean)), device=device)
    model = build_model(args, device, dtype)
    assert task.vocab_needed <= model.tok_embeddings.num_embeddings
    prompts, classes = task.prompts(args.prompts, args.min_prompt, args.max_prompt, seed=7)
    log(f"model: {args.model if not args.quick else 'tiny'} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params), "
        f"{args.prompts} prompts x {args.samples} samples, prompt tokens {sum(map(len, prompts))} "
        f"(min {min(map(len, prompts))}, max {max(map(len, prompts))})")

    rows = args.prompts * args.samples
    # no bucket 1 (one compile); --bucket-growth 4 keeps every other power of two: fewer graphs to capture
    buckets = tuple(batch_buckets(rows, args.bucket_growth, smallest=2))
    cfg = EngineConfig(max_rows=rows, max_prompts=args.prompts, max_prompt_len=args.max_prompt,
                       max_new_tokens=args.max_new, max_draft=args.max_draft, sync_every=args.sync_every,
                       compile=cuda or args.compile, cuda_graphs=cuda, prefill_tokens=max(32768, args.max_prompt),
                       batch_buckets=buckets)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, stop_token_ids=(EOS,), seed=0)
    results: list[dict] = []
    extra: dict = {"classes": classes, "class_mean_lengths": task.means, "task_entropy_nats": task_entropy(task)}

    # drafter variants to try, in order: a failure to compile / capture one falls back to the next
    window = args.window or None
    variants = [(args.weight, window)]
    for v in (("none", window), (args.weight, None), ("none", None)):
        if v not in variants:
            variants.append(v)
    engine = drafter = costs = None
    for weight, win in variants:
        try:
            drafter = QuantizedSelfDrafter(model, DrafterConfig(weight=weight, window=win, sink=args.sink))
            engine = RolloutEngine(model, cfg, drafter=drafter)
            log(f"drafter: {drafter!r}; weight bytes {drafter.weight_nbytes() / 2**20:.0f} MiB vs target "
                f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.0f} MiB")
            t = time.perf_counter()
            prep = engine.prepare(params, draft_lengths=tuple(args.lengths) + (args.always_k,))
            log(f"compiled and captured the decode / draft / cycle steps for all buckets in {prep:.1f}s "
                f"(KV cache {engine.cache_nbytes() / 2**30:.1f} GiB)")
            costs = CostModel.calibrate(engine, params, draft_lengths=(min(args.lengths), max(args.lengths)),
                                        steps=args.calib_steps,
                                        cache_dir=None if args.quick else Path.home() / ".cache" / "sparrow")
            extra["prepare_s"], extra["calibration_s"] = prep, time.perf_counter() - t - prep
            break
        except Exception:  # noqa: BLE001 - report, free the engine, try a simpler drafter
            traceback.print_exc()
            log(f"drafter weight={weight} window={win} failed; trying the next variant")
            engine = drafter = costs = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    if costs is None:
        raise RuntimeError("no drafter variant could be compiled and calibrated")
    extra["drafter"] = repr(drafter)
    log(f"calibrated costs in {costs.meta.get('seconds', 0.0):.1f}s (contexts {costs.meta.get('contexts')})")
    ctx_mid = (args.min_prompt + args.max_prompt) / 2
    cal_rows = []
    for b in costs.buckets:
        row = {"bucket": b, "ctx": int(ctx_mid), "target_ms": 1e3 * costs.target_step(b, ctx_mid),
               "draft_ms": 1e3 * costs.draft_step(b, ctx_mid)}
        for k in sorted(set(args.lengths)):
            row[f"verify{k}_ms"] = 1e3 * costs.verify_step(b, ctx_mid, k)
        for a in (0.7, 0.9):
            row[f"best_speedup@a={a}"] = max(costs.speedup(b, ctx_mid, k, a) for k in args.lengths)
        cal_rows.append(row)
    extra["calibration"] = cal_rows
    print("\nCost model (calibrated on this engine; ms per step at the middle context):")
    print_table(cal_rows, list(cal_rows[0].keys()))
    deadline = T0 + 60 * args.deadline_minutes if args.deadline_minutes else None
    config = ({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
              | {"model_shape": "tiny" if args.quick else f"qwen2.5-{args.model}", "drafter": repr(drafter),
                 "dtype": str(dtype)})

    def save(phase_rows: list[dict]) -> None:
        done = [r for r in results if r["phase"] != phase_rows[0]["phase"]] + phase_rows
        write_json(NAME + ("_quick" if args.quick else ""), config, done, args.out, extra=extra)

    if args.random:
        log("phase 'random' (random weights: latency only, acceptance not meaningful; they rarely stop, so "
            "responses are capped at 1024 tokens)")
        try:
            rparams = SamplingParams(temperature=1.0, max_new_tokens=min(args.max_new, 1024), stop_token_ids=(EOS,))
            results += run_phase("random", engine, prompts, rparams, args, costs, save, deadline)
        except Exception:  # noqa: BLE001 - report and continue with the trained phase
            traceback.print_exc()

    log(f"training on the synthetic task for {args.train_seconds:.0f}s (loss floor inside episodes "
        f"~{task_entropy(task):.2f} nats)")
    extra["training"] = train(model, task, args.train_seconds, args.train_seq, args.train_batch, args.lr, device,
                              warmup=args.warmup_steps)
    log(f"trained {extra['training']['steps']} steps, {extra['training']['tokens'] / 1e6:.1f}M tokens, "
        f"final loss {extra['training']['final_loss']:.3f}")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    drafter.refresh()  # a weight sync happened: re-quantize in place (graphs stay valid)
    drafter.refresh()
    extra["refresh_s"] = drafter.last_refresh_s
    log(f"drafter.refresh(): {drafter.last_refresh_s * 1e3:.1f} ms")

    log("phase 'trained'")
    results += run_phase("trained", engine, prompts, params, args, costs, save, deadline)  # saved as it went
    for phase in sorted({r["phase"] for r in results}, key=lambda x: x != "random"):
        rows = [r for r in results if r["phase"] == phase]
        note = ("acceptance from random weights: NOT meaningful" if phase == "random"
                else "acceptance from the model trained here on the synthetic task")
        print(f"\nPhase '{phase}' ({note}):")
        print_table(rows, ["run", "latency_s", "prefill_s", "decode_s", "tokens", "decode_tok_s", "speedup_vs_ar",
                           "latency_reduction", "acceptance", "tokens_per_cycle", "len_p50", "len_max"])
        print(f"decode tokens/s per batch bucket ('phase {phase}'):")
        bt = bucket_table(rows)
        print_table(bt, list(bt[0].keys()) if bt else ["bucket"])
    if args.per_batch_tokens:
        log(f"phase 'per_batch' ({args.per_batch_tokens} tokens per row, the batch held fixed)")
        extra["per_batch"] = per_batch_phase(engine, prompts, args, costs, deadline)
        if results:
            save([r for r in results if r["phase"] == results[-1]["phase"]])  # rewrites the JSON with the table
        if extra["per_batch"]:
            print("\ndecode tokens/s at a fixed active batch:")
            print_table(extra["per_batch"], list(extra["per_batch"][0].keys()))
    print(f"\ndrafter refresh (re-quantize in place after a weight sync): {extra['refresh_s'] * 1e3:.1f} ms")


def plot(result: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("phase") == "trained"] or result["rows"]
    per_batch = result.get("per_batch") or []
    fig, ax = plt.subplots(1, 3 if per_batch else 2, figsize=(16 if per_batch else 11, 4))
    for r in rows:
        b = sorted(int(x) for x in r["bucket_tok_s"])
        ax[0].plot(b, [r["bucket_tok_s"][str(x)] if str(x) in r["bucket_tok_s"] else r["bucket_tok_s"][x] for x in b],
                   marker="o", label=r["run"])
    ax[0].set_xscale("log", base=2)
    ax[0].set_xlabel("active batch bucket")
    ax[0].set_ylabel("decode tokens/s")
    ax[0].legend()
    ax[1].bar([r["run"] for r in rows], [r["latency_s"] for r in rows])
    ax[1].set_ylabel("rollout latency (s)")
    if per_batch:
        bs = [r["batch"] for r in per_batch]
        for key in [k for k in per_batch[0] if k.endswith("/AR")]:
            ax[2].plot(bs, [r.get(key) for r in per_batch], marker="o", label=key.replace(" /AR", ""))
        ax[2].axhline(1.0, color="grey", lw=0.8)
        ax[2].set_xscale("log", base=2)
        ax[2].set_xlabel("active batch (held fixed)")
        ax[2].set_ylabel("decode speed vs AR (x)")
        ax[2].legend()
    save_figure(fig, png, "Speculative rollout (" + result["config"].get("model_shape", "") + ")")


if __name__ == "__main__":
    main()

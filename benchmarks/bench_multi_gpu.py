"""Decoupled trainer and rollout ranks on several GPUs: GRPO step and weight-sync times, sparse vs dense sync,
with the rollout copy's bits checked against the trainer's after every sync.

Layouts (``--gpus N``, one ``tune run --nproc_per_node N sparrow_grpo`` each): with 2 GPUs one trainer and one
rollout rank; with 4, one trainer and three rollout ranks (the sync is a broadcast), then two FSDP2 trainers
and two rollout ranks (``trainer_ranks=2``). Each layout runs twice, ``sync.codec=auto`` (sparse) and
``sync.codec=dense``, from the same seed.

Model: Qwen2.5-1.5B's shape (28 layers, width 1536, 12 query / 2 kv heads, MLP 8960) over the character
vocabulary of :class:`~sparrow.rl.CharTokenizer` — 1.31B parameters, random init (``init_std``) — trained in
bf16 autocast with fp32 master weights and AdamW at lr 1e-6 (the regime where ~1-4% of bf16 elements change per
step; the reward is character accuracy, so a random model's groups have non-zero advantages and the weights
move). Task: :class:`~sparrow.rl.KVRetrieval` at ``--context`` tokens, ``--prompts`` x 8 samples per step.
The recipe config is the shipped ``recipes/configs/tiny_kv_retrieval.yaml`` with overrides (listed in the
JSON). Every run has ``sync.check_bitwise=1``: the run stops if any rollout rank's bits differ after a sync, and
``sync/bitwise_checked`` counts the checks that passed. NVLink multicast is kept off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).

Reported per run (medians over the steps after ``--warmup-steps``): step time, rollout / train time, sync time
on the sender (``time/sync_s``: encode + send), the whole sync on the device (``time/sync_total_s``: gather,
send, receive, apply and the bit check), wire and dense bytes. Summary: dense / sparse sync time per layout.

Usage: ``python benchmarks/bench_multi_gpu.py --gpus 2`` (a 2-GPU machine, ~5 min) or ``--gpus 4``; ``--quick``
runs a tiny model on CPU processes (gloo), a smoke test of the script.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sparrow.bench import (REPO, bar_groups, base_parser, pick, print_table, save_figure, subplots,
                           triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.rl.launch import launch_recipe, recipe_env
from sparrow.rl.runs import median

NAME = "multi_gpu"
CONFIG = REPO / "recipes" / "configs" / "tiny_kv_retrieval.yaml"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def model_overrides(args) -> list[str]:
    if args.quick:
        dims = dict(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, intermediate_dim=128)
    else:
        dims = dict(num_layers=28, embed_dim=1536, num_heads=12, num_kv_heads=2, intermediate_dim=8960)
    seq = args.context + 1 + args.max_new + 8
    return [f"model.{k}={v}" for k, v in dims.items()] + [f"model.max_seq_len={seq}"]


def overrides(args, out: Path) -> list[str]:
    cuda = not args.quick
    o = [
        f"output_dir={out}", "checkpoint=null", "init_std=0.02", f"total_steps={args.steps}", "checkpoint_every=0",
        "eval.every=0", "plot=false", f"task.context_len={args.context}", "task.key_len=3", "task.value_len=3",
        "task.vary_pairs=false", f"engine.max_prompt_len={args.context + 1}", f"engine.max_new_tokens={args.max_new}",
        f"sampling.max_new_tokens={args.max_new}", f"prompts_per_step={args.prompts}", "group_size=8",
        f"engine.max_rows={8 * args.prompts}", "micro_batch_size=16", "optimizer.lr=1e-6",
        "optimizer.betas=[0.9,0.999]", "sync.check_bitwise=1", "sync.verify=true",
        "reward._component_=sparrow.rl.CharAccuracy",  # partial credit: non-zero advantages from a random model
        "metric_logger._component_=sparrow.rl.JsonlLogger", f"metric_logger.log_dir={out}/logs",
        f"device={'cuda' if cuda else 'cpu'}", f"trainer_precision={'bf16-mixed' if cuda else 'fp32'}",
        f"engine.compile={'true' if cuda else 'false'}", "dist_timeout_s=600"]
    if cuda:
        o += ["engine.cuda_graphs=true", "engine.block_steps=16", "optimizer.fused=true"]
    return o + model_overrides(args)


def layouts(gpus: int) -> list[tuple[int, int]]:
    """(processes, trainer ranks) for this many GPUs."""
    if gpus < 2:
        raise SystemExit("--gpus must be at least 2")
    out = [(2, 1)]
    if gpus >= 4:
        out += [(4, 1), (4, 2)]
    return out


def run_one(args, nproc: int, trainers: int, codec: str, work: Path) -> dict:
    out = work / f"n{nproc}_t{trainers}_{codec}"
    shutil.rmtree(out, ignore_errors=True)
    env = recipe_env(**NO_MULTICAST, **({"OMP_NUM_THREADS": "1"} if args.quick else {}))
    run = launch_recipe(CONFIG, [*overrides(args, out), f"trainer_ranks={trainers}", f"sync.codec={codec}"], out=out,
                        nproc=nproc, env=env, timeout=args.timeout, cwd=work, check=False)
    row = {"processes": nproc, "trainers": trainers, "rollout_ranks": nproc - trainers, "codec": codec,
           "returncode": run.returncode, "wall_s": run.wall_s}
    if run.returncode != 0:
        row["error"] = run.output[-4500:].strip()
        print(f"run failed ({nproc} processes, {trainers} trainers, {codec}):\n{row['error']}", flush=True)
        return row
    recs = run.steps
    timed = [r for r in recs if r["step"] > args.warmup_steps] or recs
    med = lambda key: median(r.get(key) for r in timed)  # noqa: E731
    row.update({
        "steps": len(recs), "timed_steps": len(timed), "step_s": med("time/step_s"), "rollout_s": med("time/rollout_s"),
        "train_s": med("time/train_s"), "sync_send_s": med("time/sync_s"), "sync_total_s": med("time/sync_total_s"),
        "sync_gather_s": med("time/sync_gather_s"), "wire_mb": (med("sync/wire_bytes") or 0) / 1e6,
        "dense_mb": (med("sync/dense_bytes") or 0) / 1e6, "density": med("sync/density"),
        "bitwise_checks_passed": int(sum(r.get("sync/bitwise_checked", 0) for r in recs)),
    })
    return row


def run(args) -> None:
    if args.quick:
        args.gpus, args.context, args.max_new, args.prompts, args.steps = 2, 48, 4, 2, 3
        args.warmup_steps = 1
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for nproc, trainers in layouts(args.gpus):
        for codec in ("auto", "dense"):
            row = run_one(args, nproc, trainers, codec, work)
            rows.append(row)
            print_table([row], [k for k in row if k != "error"])
    summary = []
    for nproc, trainers in layouts(args.gpus):
        pair = {r["codec"]: r for r in rows if r["processes"] == nproc and r["trainers"] == trainers}
        s, d = pair.get("auto", {}), pair.get("dense", {})
        if s.get("sync_total_s") and d.get("sync_total_s"):
            summary.append({"processes": nproc, "trainers": trainers, "sparse_sync_s": s["sync_total_s"],
                            "dense_sync_s": d["sync_total_s"], "sync_speedup": d["sync_total_s"] / s["sync_total_s"],
                            "payload_ratio": d["wire_mb"] / max(s["wire_mb"], 1e-12),
                            "sparse_step_s": s["step_s"], "dense_step_s": d["step_s"]})
    print()
    if summary:
        print_table(summary, list(summary[0]))
    config = {"gpus": args.gpus, "context": args.context, "max_new": args.max_new, "prompts": args.prompts,
              "group": 8, "steps": args.steps, "warmup_steps": args.warmup_steps, "quick": args.quick,
              "recipe_config": str(CONFIG.relative_to(REPO)),
              "overrides": overrides(args, Path("OUT")), "env": NO_MULTICAST}
    write_json(NAME, config, rows, args.out, extra={"summary": summary,
                                                   "failed": [r for r in rows if r["returncode"] != 0]})
    if any(r["returncode"] != 0 for r in rows):
        raise SystemExit("some runs failed (see 'failed' in the JSON)")


def plot(result: dict, png_path: Path) -> None:
    rows = [r for r in result["rows"] if r.get("returncode") == 0]
    labels = sorted({(r["processes"], r["trainers"]) for r in rows})
    fig, axes = subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "sync_total_s", "weight sync (device, incl. bit check)"),
                           (axes[1], "step_s", "GRPO step")):
        bar_groups(ax, [f"{p} GPUs\n{t} trainer(s)" for p, t in labels], {
            name: [pick(rows, key, 0, processes=p, trainers=t, codec=codec) for p, t in labels]
            for codec, name in (("auto", "sparse (auto)"), ("dense", "dense"))}, width=0.76)
        ax.set_ylabel("seconds (median)")
        ax.set_title(title)
        ax.legend(loc="lower center", framealpha=0.9)
    model = "a tiny model on CPU processes" if result["config"].get("quick") else "1.3B model"
    save_figure(fig, png_path, f"Decoupled trainer / rollout ranks, {model}, sparse vs dense weight sync")


def main() -> None:
    run(base_parser(__doc__.splitlines()[0], [
        ("--gpus", int, 2, None), ("--context", int, 2048, None), ("--max-new", int, 16, None),
        ("--prompts", int, 8, "prompts per step (x 8 samples)"), ("--steps", int, 6, None),
        ("--warmup-steps", int, 2, "first steps left out of the medians"), ("--timeout", int, 900, "seconds per run"),
        ("--work-dir", str, "multi_gpu_runs", None)]).parse_args())

if __name__ == "__main__":
    main()

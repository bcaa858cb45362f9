"""Scaling curves: step time and model state per rank vs world size and vs model size, for every strategy.

    python -m benchmarks.scaling                     # the measurement behind docs/benchmarks.md (est. 6-8 min)
    nice -n 19 python -m benchmarks.scaling --quick  # tiny smoke run; writes only under the temp dir

Curve A (strong scaling): the benchmark GPT with 8 layers (pipeline stages need a piece each) and a fixed
global batch of 16 sequences at worlds 1, 2, 4, 8. Curve B: GPTs of 4 layers, d_model 128/256/512, at world
4. Strategies, all through `paratrain.initialize`: DDP (stage 0), ZeRO-1/2/3 over all ranks, TP over all
ranks (tensor_parallel.size = world), PP over all ranks (pipeline.stages = world, 1F1B, m = 2 x stages).
At world 1 every strategy is one process training the whole model: the DDP point, reused, not re-measured.

Every point runs in a fresh spawned world (its peak RSS is its own). Per point: the median over measured
steps of the slowest rank's step time, the largest rank's `engine.memory_stats()["total"]` against the
model-state formula, the largest rank's peak RSS and the last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from benchmarks.common import (
    BENCH_MODEL,
    LocalBatches,
    Timer,
    bench_model,
    check_same_setup,
    paratrain_optimizer,
    record_setup,
    run_case,
)
from benchmarks.scaling_plot import plot
from benchmarks.suite import DOC, RESULTS, ROOT, machine
from paratrain.models import GPTConfig, gpt_config
from paratrain.planner.states import ceil_div, model_state_bytes

STRATEGIES = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP", "PP"]
ZERO_STAGE = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}
FORMULA = {"DDP": "16Ψ", "ZeRO-1": "8Ψ+8Ψ/N", "ZeRO-2": "4Ψ+12Ψ/N", "ZeRO-3": "16Ψ/N", "TP": "16Ψ/N", "PP": "16Ψ/N"}
# d_ff = 4 d_model is explicit: the benchmark preset fixes d_ff = 1024, which would not grow with d_model.
FULL = dict(global_batch=16, worlds=(1, 2, 4, 8), world_model=dict(n_layer=8),
            size_world=4, size_models=[dict(n_layer=4, d_model=d, d_ff=4 * d) for d in (128, 256, 512)])
QUICK = dict(global_batch=4, worlds=(1, 2), world_model=dict(n_layer=2, d_model=32, d_ff=128, n_head=4, seq_len=32),
             size_world=2, size_models=[dict(n_layer=2, d_model=d, d_ff=4 * d, n_head=4, seq_len=32) for d in (16, 32)])
IMAGES, MIB = ROOT / "docs" / "images", 2**20
SAME_AS_DDP = "one process: the DDP point"
MARK, END_MARK = "<!-- scaling -->", "<!-- /scaling -->"


def model_config(model: dict) -> GPTConfig:
    """The config `bench_model(**model)` builds."""
    return gpt_config("gpt-small", **{**BENCH_MODEL, **model})


def describe(model: dict) -> str:
    c = model_config(model)
    return f"GPT {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, d_ff {c.d_ff}, seq {c.seq_len}"


def formula_bytes(strategy: str, psi: int, n: int) -> int:
    """Model-state bytes per rank of fp32 AdamW (4 param + 4 grad + 8 moments) by the formula of `strategy`;
    TP and PP split the model N ways (their replicated norms / uneven stages come on top)."""
    if strategy in ZERO_STAGE:
        return model_state_bytes(psi, n, ZERO_STAGE[strategy]).total
    return 16 * ceil_div(psi, n)


def skip_reason(strategy: str, world: int, model: dict, global_batch: int) -> str | None:
    """Why this point cannot run (or is the DDP point itself), else None."""
    cfg = model_config(model)
    if world == 1 and strategy != "DDP":
        return SAME_AS_DDP
    if strategy in ZERO_STAGE and global_batch % world:
        return f"global batch {global_batch} does not split over {world} ranks"
    if strategy == "TP" and any(x % world for x in (cfg.n_head, cfg.d_model, cfg.d_ff, cfg.vocab_size)):
        return f"heads/d_model/d_ff/vocab not divisible by {world}"
    if strategy == "PP" and (cfg.n_layer + 2 < world or global_batch % (2 * world)):
        return f"{cfg.n_layer} layers + embed + head or the batch do not fill {world} stages"
    return None


def run_point(strategy: str, model: dict, global_batch: int, steps: int, warmup: int) -> dict:
    """One rank of one point (runs in a spawned world with gloo initialized)."""
    import paratrain

    n, rank, seq = dist.get_world_size(), dist.get_rank(), model_config(model).seq_len
    cfg = {"gradient_clipping": 1.0, "optimizer": paratrain_optimizer()}
    if strategy in ZERO_STAGE:  # stage 3 shards every parameter (the formula's 16Ψ/N), as benchmarks/zero.py
        dp, m = n, 1
        cfg["zero_optimization"] = {"stage": ZERO_STAGE[strategy], "stage3_param_persistence_threshold": 0}
    elif strategy == "TP":
        dp, m = 1, 1  # every tp rank sees the whole batch
        cfg["tensor_parallel"] = {"size": n}
    else:
        dp, m = 1, 2 * n  # m = 2p micro-batches as in benchmarks/pp.py: 1F1B bubble (p-1)/(3p-1)
        cfg["pipeline"] = {"stages": n, "schedule": "1f1b"}
    micro = global_batch // (dp * m)
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=m)
    batches = LocalBatches(micro, dp, rank % dp, m, seq_len=seq)
    gpt = bench_model(**model)
    engine, *_ = paratrain.initialize(model=gpt, config=cfg)
    timer = Timer(warmup, record_setup(engine.optimizer, gpt, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    rank_params = sum(p.numel() for p in engine.module.parameters() if p.device.type != "meta")
    return timer.result(state_bytes=engine.memory_stats()["total"], rank_params=rank_params)


def measure(strategy: str, world: int, model: dict, global_batch: int, steps: int, warmup: int) -> dict:
    from paratrain.testing import World

    for attempt in (1, 2):  # a world killed by the shared machine (memory, load) gets one retry
        try:
            with World(world, timeout_s=900) as w:
                ranks = w.run(run_case, f"{strategy} world {world}", run_point, strategy, model, global_batch, steps,
                              warmup)
            break
        except Exception as error:
            print(f"[scaling] {strategy} world {world} failed ({attempt}/2): {error}", file=sys.stderr, flush=True)
            if attempt == 2:
                raise
    check_same_setup({f"{strategy} world {world} rank {i}": r["setup"] for i, r in enumerate(ranks)})
    slowest = [max(step) for step in zip(*(r["step_times"] for r in ranks))]
    psi = model_config(model).num_params()
    point = {"strategy": strategy, "world": world, "model": model, "params": psi,
             "median_step_s": statistics.median(slowest), "step_times_slowest": slowest,
             "state_bytes": max(r["state_bytes"] for r in ranks), "formula_bytes": formula_bytes(strategy, psi, world),
             "state_bytes_per_rank": [r["state_bytes"] for r in ranks], "peak_rss": max(r["peak_rss"] for r in ranks),
             "last_loss": ranks[0]["losses"][-1], "losses": ranks[0]["losses"], "setup": ranks[0]["setup"]}
    if strategy in ("TP", "PP"):  # what the replicated / uneven parts add: 16 x the largest rank's parameters
        point["rank_formula_bytes"] = 16 * max(r["rank_params"] for r in ranks)
    return point


def run_curve(name: str, plan: list[tuple[str, int, dict]], global_batch: int, steps: int, warmup: int,
              done: dict, start: float) -> list[dict]:
    """Measure each (strategy, world, model) of `plan` once; `done` (shared by the curves) holds what is
    measured, so a point both curves contain and the world-1 points of the other strategies are reused."""
    points = []
    for strategy, world, model in plan:
        key = (world, json.dumps(model, sort_keys=True))
        reason = skip_reason(strategy, world, model, global_batch)
        if reason == SAME_AS_DDP and ("DDP", *key) in done:
            ddp = done[("DDP", *key)]
            points.append({**ddp, "strategy": strategy, "reused_from": "DDP",
                           "formula_bytes": formula_bytes(strategy, ddp["params"], world)})
        elif reason:
            points.append({"strategy": strategy, "world": world, "model": model, "skipped": reason})
        else:
            if (strategy, *key) not in done:
                print(f"[scaling {name}] {strategy} world {world} {model} ({time.time() - start:.0f} s so far)",
                      file=sys.stderr, flush=True)
                done[(strategy, *key)] = measure(strategy, world, model, global_batch, steps, warmup)
            points.append(done[(strategy, *key)])
    return points


def table(points: list[dict], key: str) -> str:
    head = ["strategy", "world" if key == "world" else "params Ψ", "median step (ms)", "model state / rank (MiB)",
            "formula", "formula (MiB)", "state / formula", "16 × params on rank (MiB)", "peak RSS / rank (MiB)",
            "last loss"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for p in points:
        first = str(p["world"]) if key == "world" else f"{p['params'] / 1e6:.2f}M (d_model {p['model']['d_model']})"
        if "skipped" in p:
            lines.append(f"| {p['strategy']} | {first} | skipped: {p['skipped']} |" + " |" * (len(head) - 3))
            continue
        rank = f"{p['rank_formula_bytes'] / MIB:.2f}" if "rank_formula_bytes" in p else "—"
        note = " (DDP's point)" if "reused_from" in p else ""
        lines.append(f"| {p['strategy']}{note} | {first} | {p['median_step_s'] * 1e3:.0f} "
                     f"| {p['state_bytes'] / MIB:.2f} | {FORMULA[p['strategy']]} | {p['formula_bytes'] / MIB:.2f} "
                     f"| {p['state_bytes'] / p['formula_bytes']:.3f} | {rank} | {p['peak_rss'] / MIB:.0f} "
                     f"| {p['last_loss']:.4f} |")
    return "\n".join(lines)


def findings(world_points: list[dict], size_points: list[dict]) -> str:
    """The sentences under the tables, computed from the measurement (no number is typed in by hand)."""
    a = {(p["strategy"], p["world"]): p for p in world_points if "skipped" not in p}
    lo, hi = min(w for _, w in a), max(w for _, w in a)
    speed = ", ".join(f"{s} {a[s, lo]['median_step_s'] / a[s, hi]['median_step_s']:.2f}x"
                      for s in STRATEGIES if (s, lo) in a and (s, hi) in a)
    cores, mib = os.cpu_count(), lambda p: f"{p['state_bytes'] / MIB:.1f} MiB"  # noqa: E731
    text = [f"With the global batch fixed, the speed-up from {lo} to {hi} ranks (step time at {lo} / at {hi}) is "
            f"{speed}; this machine has {cores} cores, so beyond {cores} ranks the processes share cores and more "
            f"ranks add communication and scheduling, not compute."]
    if all((s, hi) in a for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")):
        z = {s: a[s, hi] for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}
        formulas = ", ".join(f"{FORMULA[s]} = {v['formula_bytes'] / MIB:.1f}" for s, v in z.items())
        text.append(f"At world {hi} the model state per rank is {mib(z['DDP'])} for DDP, {mib(z['ZeRO-1'])} for "
                    f"ZeRO-1, {mib(z['ZeRO-2'])} for ZeRO-2 and {mib(z['ZeRO-3'])} for ZeRO-3 ({formulas} MiB).")
    if tp_pp := [p for p in a.values() if "rank_formula_bytes" in p and p["world"] == hi]:
        text.append("TP and PP hold more than 16Ψ/N because some parameters are not split: " + ", ".join(
            f"{p['strategy']} at world {hi} {p['rank_formula_bytes'] / p['formula_bytes'] - 1:+.1%}" for p in tp_pp)
            + " (TP: replicated norms and position embedding; PP: the largest stage).")
    measured = list({id(p): p for p in world_points + size_points if "skipped" not in p and "reused_from" not in p}
                    .values())
    # The expectation: the formula; for TP/PP 16 x the largest rank's parameters (replicated / uneven parts in).
    off_of = lambda p: abs(p["state_bytes"] / p.get("rank_formula_bytes", p["formula_bytes"]) - 1)  # noqa: E731
    worst = max(measured, key=off_of)
    off = off_of(worst)
    text.append(f"The counted state equals that expectation exactly at all {len(measured)} measured points." if off == 0
                else f"Over the {len(measured)} measured points the counted state differs from that expectation by at "
                f"most {off:.2%} ({worst['strategy']}, world {worst['world']}, Ψ = {worst['params'] / 1e6:.2f}M).")
    if b := [p for p in size_points if "skipped" not in p]:
        small, large = min(p["params"] for p in b), max(p["params"] for p in b)
        growth = ", ".join(f"{s} {big['median_step_s'] / lit['median_step_s']:.1f}x" for s in STRATEGIES
                           for lit in b if lit["strategy"] == s and lit["params"] == small
                           for big in b if big["strategy"] == s and big["params"] == large)
        text.append(f"From Ψ = {small / 1e6:.2f}M to {large / 1e6:.2f}M ({large / small:.1f}x) the step time grows "
                    f"by {growth}.")
    return " ".join(text)


def section(result: dict, command: str, image_dir: str) -> str:
    a, b = result["curve_world"], result["curve_model"]
    return (f"{MARK}\n### Scaling: step time and model state vs world size and model size\n\n"
            f"Measured {result['date']} on {result['machine']}. fp32, AdamW, clipping 1.0, "
            f"{result['steps']} measured steps after {result['warmup']} warm-up; a step's time is its slowest rank's. "
            f"Model state is `engine.memory_stats()['total']` of the largest rank; peak RSS is `ru_maxrss` of the "
            f"largest rank, each point in a fresh world.\n\nCommand: `{command}`\n\n"
            f"**Curve A, vs world size** (strong scaling): {describe(result['world_model'])}, Ψ = "
            f"{a[0]['params'] / 1e6:.2f}M, global batch {result['global_batch']} sequences.\n\n{table(a, 'world')}\n\n"
            f"![step time and model state vs world size]({image_dir}/scaling_world.png)\n\n"
            f"**Curve B, vs model size** at world {result['size_world']}, global batch {result['global_batch']}: "
            f"{'; '.join(describe(m) for m in result['size_models'])}.\n\n"
            f"{table(b, 'params')}\n\n![step time and model state vs parameters]({image_dir}/scaling_model.png)\n\n"
            f"{findings(a, b)}\n{END_MARK}")


def write_section(doc: Path, text: str) -> None:
    """Replace the section between the markers, or append it; the rest of the file stays as it is."""
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    head, found, rest = old.partition(MARK)
    doc.write_text(head + text + rest.split(END_MARK, 1)[1] if found and END_MARK in rest
                   else old.rstrip() + "\n\n" + text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-doc", action="store_true", help="write the JSON and print, leave docs/ untouched")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run: results, images and section go to "
                        "the temp dir, nothing in the repository is touched")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    start, done = time.time(), {}
    curve_world = run_curve("world", [(s, w, plan["world_model"]) for w in plan["worlds"] for s in STRATEGIES],
                            plan["global_batch"], args.steps, args.warmup, done, start)
    curve_model = run_curve("model", [(s, plan["size_world"], m) for m in plan["size_models"] for s in STRATEGIES],
                            plan["global_batch"], args.steps, args.warmup, done, start)
    # every point trained with the same optimizer, threads, dtype and seeds, or the curves compare nothing
    check_same_setup({f"{p['strategy']} world {p['world']} {p['model']}": p.get("setup")
                      for p in curve_world + curve_model if "skipped" not in p})
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "steps": args.steps, "warmup": args.warmup,
              **{k: plan[k] for k in ("global_batch", "world_model", "size_world", "size_models")},
              "seconds": round(time.time() - start), "curve_world": curve_world, "curve_model": curve_model}
    out, images = (Path(tempfile.gettempdir()) / "paratrain_scaling_quick",) * 2 if args.quick else (RESULTS, IMAGES)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=1))
    command = "python -m benchmarks.scaling" + "".join(
        f" --{k} {v}" for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v != parser.get_default(k))
    text = section(result, command + (" --quick" if args.quick else ""), "images" if not args.quick else str(out))
    print(text)
    if args.quick or not args.no_doc:
        plot(curve_world, "world", images / "scaling_world.png", "world size (ranks)", STRATEGIES)
        plot(curve_model, "params", images / "scaling_model.png", "parameters Ψ", STRATEGIES)
    if not args.quick and not args.no_doc:
        write_section(DOC, text)
    print(f"done in {result['seconds']} s; results in {out / 'scaling.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

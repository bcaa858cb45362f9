"""Does the planner rank layouts the way this machine does? Calibrate, predict, measure, compare.

    python -m benchmarks.planner_ranking              # writes docs/benchmarks.md's section (--no-doc: print only)
    python -m benchmarks.planner_ranking --repredict  # the committed run, predicted by the planner as it is now

1. Calibrate `Hardware` for this CPU on one process and two: one process times an engine step on 8 sequences as
   one micro-batch and as 8 accumulated ones (-> a per-micro-batch overhead from the difference, FLOP/s from the
   rest) and an AdamW step (-> memory bandwidth); two processes time gloo all-reduces of 1 and of Psi floats (->
   latency and bandwidth), each collective the layouts use through `paratrain.comm` after a stretch of compute, at
   three payloads (-> `Hardware.op_costs`), and a forward + backward on both at once (-> how much they slow each
   other, `Hardware.shared_host_slowdown`). Communication is not overlapped: gloo's threads share the cores.
2. Predict the step time of 14 layouts of one global batch (one process, DDP with different micro-batch /
   accumulation splits, ZeRO-1/3, TP with and without SP, 1F1B and GPipe pipelines, ring context parallelism)
   with `paratrain.planner.estimate_time`.
3. Measure each layout's step time with the engine (fresh world per case, cases interleaved, medians).
4. Report both rankings, Spearman's rho, Kendall's tau, and whether the predicted best is the measured best.
The machine is shared and noisy: the tests check the result is the current planner's and its stated bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import BENCH_MODEL, LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup
from benchmarks.rank_agreement import decisive_agreement, kendall, ranks, spearman
from benchmarks.suite import RESULTS, write_doc
from paratrain.models import GPTConfig
from paratrain.planner import Hardware, Layout, estimate_time, layout_config, shape_from_config
from paratrain.testing import World

SPEC = shape_from_config(GPTConfig(**BENCH_MODEL), "gpt-small")
GLOBAL_BATCH = 16
# 14 layouts of one global batch, of 6 kinds: one process and DDP (micro-batch / accumulation splits),
# ZeRO-1 and ZeRO-3, tensor parallelism (with and without sequence parallelism), pipelines, context parallelism.
LAYOUTS = [Layout(precision="fp32", **kw) for kw in (
    dict(dp=1, micro_batch=16, grad_accum=1), dict(dp=1, micro_batch=4, grad_accum=4),
    dict(dp=1, micro_batch=1, grad_accum=16), dict(dp=2, micro_batch=8, grad_accum=1),
    dict(dp=2, micro_batch=2, grad_accum=4), dict(dp=2, micro_batch=1, grad_accum=8),
    dict(dp=2, zero_stage=1, micro_batch=4, grad_accum=2), dict(dp=2, zero_stage=3, micro_batch=4, grad_accum=2),
    dict(dp=1, tp=2, micro_batch=8, grad_accum=2),
    dict(dp=1, tp=2, sequence_parallel=True, micro_batch=4, grad_accum=4),
    dict(dp=1, pp=2, schedule="1f1b", micro_batch=4, grad_accum=4),
    dict(dp=1, pp=2, schedule="gpipe", micro_batch=2, grad_accum=8),
    dict(dp=1, cp=2, micro_batch=8, grad_accum=2), dict(dp=1, cp=2, micro_batch=2, grad_accum=8))]
TARGETS = {"spearman": 0.9, "worst_ratio": 1.5}  # issue: rank correlation at least, worst prediction error at most


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def forward_backward_seconds(repeats: int = 7) -> float:
    """One forward + backward of the benchmark GPT on 8 sequences, no communication (every rank of the world
    at once: how much two processes slow each other down)."""
    model = bench_model()
    x, y = next(LocalBatches(8, 1, 0))

    def run():
        model(x, y).backward()

    run()
    if dist.is_initialized():
        dist.barrier()
    return _median_time(run, repeats)


def calibrate_compute(repeats: int = 7) -> dict:
    """Runs in a 1-process world: the engine's optimizer step on 8 sequences as one micro-batch of 8 and as 8
    accumulated micro-batches of 1 (-> the per-micro-batch overhead from the difference: the same FLOPs), the
    first again minus its overhead and AdamW (-> FLOP/s), and AdamW alone (-> memory bandwidth)."""
    import paratrain

    times = {}
    for b, m in ((8, 1), (1, 8)):
        config = layout_config(SPEC, Layout(dp=1, micro_batch=b, grad_accum=m, precision="fp32"))
        engine, *_ = paratrain.initialize(model=bench_model(), config=config)
        batches = LocalBatches(b, 1, 0, m)
        engine.train_batch(batches)  # warm-up (creates AdamW's moments)
        times[b, m] = _median_time(lambda e=engine, it=batches: e.train_batch(it), repeats)
    t_opt = _median_time(engine.optimizer.step, repeats)
    overhead = max(0.0, (times[1, 8] - times[8, 1]) / 7)
    flops8 = 8 * SPEC.seq_len * SPEC.flops_per_token
    rate = flops8 / (times[8, 1] - t_opt - overhead)
    return {"flops_per_s": rate, "micro_batch_overhead": overhead, "memory_bandwidth": 28 * SPEC.params / t_opt,
            "t_step_mb8x1": times[8, 1], "t_step_mb1x8": times[1, 8], "t_adamw": t_opt,
            "t_forward_backward": forward_backward_seconds(repeats)}


def calibrate_comm(repeats: int = 10) -> dict:
    """Runs on each rank of a 2-process world: all-reduce of 1 float (latency) and of Psi floats (the ring
    model's constants), and each collective the layouts use, through `paratrain.comm` after a stretch of
    compute, at three payloads (1 Ki, 32 Ki and 1 Mi floats): its seconds per call and payload bytes per
    second (`Hardware.op_costs`)."""
    import paratrain.comm as comm
    from paratrain.layout.mesh import ParallelDims

    small, big = torch.zeros(1), torch.zeros(SPEC.params)
    for t in (small, big):
        dist.all_reduce(t)

    def timed(t):
        dist.barrier()
        return _median_time(lambda: dist.all_reduce(t), repeats)

    t_small, t_big = timed(small), timed(big)
    latency = t_small / 2  # a 2-rank ring all-reduce takes 2 (n - 1) = 2 steps
    bandwidth = big.numel() * 4 / max(t_big - 2 * latency, 1e-9)  # moves 2 (n-1)/n B = B per rank
    axis = comm.build_mesh(ParallelDims(2, dp=2)).axis("dp")
    peer = 1 - axis.rank

    def ops(n: int) -> dict:
        full, half, out = torch.zeros(n), torch.zeros(n // 2), torch.zeros(n)
        recv = torch.zeros(n)
        return {"all_reduce": lambda: comm.all_reduce(full, axis),
                "all_gather": lambda: comm.all_gather_into(out, half, axis),
                "reduce_scatter": lambda: comm.reduce_scatter_into(half, full, axis),
                "send": lambda: [h.wait() for h in comm.send_recv([(full, peer)], [(recv, peer)], axis)]}

    # In a training step every collective follows a stretch of compute that each rank ends at its own moment:
    # timing each op after a matmul of about a layer's work (minus the matmul alone) counts that skew and the
    # caches the compute left cold, which back-to-back calls of the op alone do not see.
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    compute = _median_time(lambda: torch.mm(a, b), repeats)
    costs = []
    sizes = (1024, 32768, 1048576)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        times = []
        for n in sizes:
            fn = ops(n)[op]
            for _ in range(3):  # the first calls on a group set up its connections and buffers
                fn()
            dist.barrier()
            times.append(_median_time(lambda f=fn: (torch.mm(a, b), f()), repeats) - compute)
        costs.append((op, *_line_fit([4 * n for n in sizes], times)))
    return {"latency": latency, "bandwidth": bandwidth, "t_small": t_small, "t_big": t_big, "op_costs": costs,
            "t_forward_backward": forward_backward_seconds(repeats)}


def _line_fit(payloads: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares `seconds = a + payload / b` through the points: (a, b), a >= 0 and b finite."""
    mx, my = statistics.fmean(payloads), statistics.fmean(seconds)
    slope = sum((x - mx) * (y - my) for x, y in zip(payloads, seconds)) / sum((x - mx) ** 2 for x in payloads)
    slope = max(slope, 1e-13)  # noise can tilt the line; no op moves bytes for free
    return max(my - slope * mx, 0.0), 1.0 / slope


def hardware_for_this_cpu(compute: dict, comm: dict) -> Hardware:
    return Hardware(gpu_memory=64 * 2**30, gpus_per_node=os.cpu_count() or 2, peak_flops=compute["flops_per_s"],
                    mfu=1.0, micro_batch_overhead=compute["micro_batch_overhead"],
                    memory_bandwidth=compute["memory_bandwidth"], intra_node_bandwidth=comm["bandwidth"],
                    inter_node_bandwidth=comm["bandwidth"], latency=comm["latency"], overlap=0.0,
                    op_costs=tuple(tuple(c) for c in comm["op_costs"]), op_costs_group=2,
                    shared_host_slowdown=max(1.0, comm["t_forward_backward"] / compute["t_forward_backward"]))


def measure_layout(config: dict, steps: int, warmup: int) -> dict:
    """Runs on every rank: the engine with the planner's config for this layout, timed per optimizer step."""
    import paratrain

    model = bench_model()
    engine, *_ = paratrain.initialize(model=model, config=config)
    # the data-parallel rank's samples: tp, pp and cp peers of a replica see the same ones
    batches = LocalBatches(engine.train_micro_batch_size_per_gpu(), engine.mesh.dims.sample_parallel_size,
                           engine.mesh.local_rank("dp"), engine.gradient_accumulation_steps())
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    return timer.result()


def calibrate() -> tuple[Hardware, dict]:
    with World(1, timeout_s=900) as world:
        compute = world.run(calibrate_compute)[0]
    with World(2, timeout_s=900) as world:
        comm = world.run(calibrate_comm)[0]
    return hardware_for_this_cpu(compute, comm), {"compute": compute, "comm": comm}


def run(repeats: int, steps: int, warmup: int) -> dict:
    """Each repeat calibrates, predicts and measures every layout, so a slow drift of this shared machine
    moves the calibration and the measurements together; the medians over repeats are compared."""
    predicted_runs: list[list[float]] = [[] for _ in LAYOUTS]
    measured_runs: list[list[float]] = [[] for _ in LAYOUTS]
    hardware, calibrations = [], []
    for r in range(repeats):
        print(f"[planner_ranking] repeat {r + 1}/{repeats}: calibrating", file=sys.stderr, flush=True)
        hw, calibration = calibrate()
        hardware.append(vars(hw))
        calibrations.append(calibration)
        for i, lay in enumerate(LAYOUTS):
            print(f"[planner_ranking] repeat {r + 1}/{repeats}: {lay.describe()}", file=sys.stderr, flush=True)
            predicted_runs[i].append(estimate_time(SPEC, lay, hw).total)
            config = layout_config(SPEC, lay, {"optimizer": paratrain_optimizer()})
            with World(lay.world, timeout_s=900) as world:
                ranks = world.run(measure_layout, config, steps, warmup)
            slowest = [max(step) for step in zip(*(rk["step_times"] for rk in ranks))]
            measured_runs[i].append(statistics.median(slowest))
    predicted = [statistics.median(runs) for runs in predicted_runs]
    measured = [statistics.median(runs) for runs in measured_runs]
    median_hw = {k: statistics.median(h[k] for h in hardware) for k in hardware[0] if k != "op_costs"}
    median_hw["op_costs"] = [[op, statistics.median(h["op_costs"][i][1] for h in hardware),
                              statistics.median(h["op_costs"][i][2] for h in hardware)]
                             for i, (op, *_) in enumerate(hardware[0]["op_costs"])]
    return _scored({"hardware": median_hw, "calibrations": calibrations, "layouts": [lay.describe() for lay in LAYOUTS],
                    "predicted_s": predicted, "measured_s": measured, "predicted_runs": predicted_runs,
                    "measured_runs": measured_runs, "repeats": repeats, "steps": steps, "targets": TARGETS})


def _scored(result: dict) -> dict:
    """`result` with how its predictions rank against its measurements."""
    predicted, measured = result["predicted_s"], result["measured_s"]
    return {**result, "spearman": spearman(predicted, measured), "kendall": kendall(predicted, measured),
            "decisive_pairs": decisive_agreement(predicted, measured),
            "worst_ratio": max(max(p / m, m / p) for p, m in zip(predicted, measured)),
            # The measured best is among the layouts the model predicts within 1% of its best.
            "best_agrees": predicted[measured.index(min(measured))] <= 1.01 * min(predicted)}


def repredict(result: dict) -> dict:
    """`result` with every prediction recomputed by the current planner from the repeats' recorded calibrations
    (the measurements kept): for a change of the cost model that leaves the measured code alone."""
    hardware = [hardware_for_this_cpu(c["compute"], c["comm"]) for c in result["calibrations"]]
    predicted_runs = [[estimate_time(SPEC, lay, hw).total for hw in hardware] for lay in LAYOUTS]
    return _scored({**result, "repredicted": time.strftime("%Y-%m-%d"), "predicted_runs": predicted_runs,
                    "predicted_s": [statistics.median(runs) for runs in predicted_runs]})


def targets_met(result: dict) -> bool:
    return result["spearman"] >= TARGETS["spearman"] and result["worst_ratio"] <= TARGETS["worst_ratio"]


def table(result: dict) -> str:
    pr, mr = ranks(result["predicted_s"]), ranks(result["measured_s"])
    hw = result["hardware"]
    lines = [f"Planner ranking of {len(pr)} layouts of one global batch ({GLOBAL_BATCH} x {SPEC.seq_len} "
             f"tokens, the benchmark GPT, fp32), {result['repeats']} repeats (each: calibrate, then every layout "
             f"in turn) x {result['steps']} measured steps.",
             f"Calibrated: {hw['peak_flops'] / 1e9:.2f} GFLOP/s per process, {hw['micro_batch_overhead'] * 1e3:.1f} "
             f"ms per micro-batch, AdamW at {hw['memory_bandwidth'] / 1e9:.2f} GB/s, gloo all-reduce "
             f"{hw['intra_node_bandwidth'] / 1e9:.2f} GB/s and {hw['latency'] * 1e6:.0f} us per ring step "
             f"(medians of the per-repeat calibrations); two processes computing at once each "
             f"{hw['shared_host_slowdown']:.2f}x slower; through paratrain.comm on 2 ranks, per call and per byte: "
             + ", ".join(f"{op} {a * 1e6:.0f} us + {b / 1e9:.2f} GB/s" for op, a, b in hw["op_costs"]) + ".", "",
             "| layout | predicted (ms) | measured (ms) | predicted / measured | predicted rank | measured rank |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, p, m, a, b in zip(result["layouts"], result["predicted_s"], result["measured_s"], pr, mr):
        lines.append(f"| {name} | {p * 1e3:.1f} | {m * 1e3:.1f} | {p / m:.2f} | {a:g} | {b:g} |")
    if "repredicted" in result:
        lines.insert(1, f"Predictions recomputed {result['repredicted']} by the planner as it is then, from the "
                        f"repeats' recorded calibrations (`--repredict`); the measurements are the run's.")
    agree, total = result["decisive_pairs"]
    lines += ["", f"Spearman rho {result['spearman']:.2f}, Kendall tau-b {result['kendall']:.2f} (ties share ranks); "
                  f"worst prediction off by {result['worst_ratio']:.2f}x; "
                  f"of the {total} pairs the model separates by more than 5%, the measurement orders {agree} the "
                  f"same way; the measured best is among the predicted best (within 1%): "
                  f"{'yes' if result['best_agrees'] else 'no'}.",
              "", f"Targets: Spearman rho at least {TARGETS['spearman']}, worst prediction within "
                  f"{TARGETS['worst_ratio']}x: {'met' if targets_met(result) else 'NOT met'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-doc", action="store_true", help="print the table, do not touch docs/benchmarks.md")
    parser.add_argument("--repredict", action="store_true",
                        help="measure nothing: recompute the committed result's predictions with the current planner")
    args = parser.parse_args(argv)
    if args.repredict:
        result = repredict(json.loads((RESULTS / "planner_ranking.json").read_text()))
        args.repeats, args.steps = result["repeats"], result["steps"]
    else:
        result = run(args.repeats, args.steps, args.warmup)
        result["measured"] = time.strftime("%Y-%m-%d")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_ranking.json").write_text(json.dumps(result, indent=1))
    body = table(result)
    print(body)
    if not args.no_doc:
        write_doc("planner_ranking", body, f"python -m benchmarks.planner_ranking --repeats {args.repeats} "
                                           f"--steps {args.steps} --warmup {args.warmup}", result.get("measured"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""paratrain's Muon against its AdamW in the same layout, and DeepSpeed 0.19.8's Muon, CPU/gloo, fp32.

    python -m benchmarks.muon                      # writes benchmarks/results/muon.json and docs/benchmarks.md
    python -m benchmarks.muon --repeats 1 --steps 1 --warmup 1 --no-doc --results /tmp/muon   # a smoke run

Every case trains the same GPT (`bench_model` with SHAPE) from the same seed on the same batches (`LocalBatches`),
one thread per rank, without gradient clipping (DeepSpeed's ZeRO-1/2 clip Muon's orthogonalized update where
torch and paratrain clip the gradient, tests/distributed/test_muon_vs_deepspeed.py: without clipping both do the
same arithmetic). The AdamW cases use the suites' fused AdamW (`benchmarks.common`); the Muon cases Muon (lr
0.02, momentum 0.95, nesterov, 5 Newton-Schulz steps, weight decay 0.1) on every hidden 2-d matrix and the output
layer (DeepSpeed's choice: every 2-d weight whose name holds neither "embed" nor "lm_head"; `muon_names` gives
the head to paratrain's Muon too), and AdamW with the suites' lr, betas, eps and weight decay on the rest.
paratrain's Newton-Schulz runs in bfloat16 (torch's default), DeepSpeed's at its default (its Gram variant,
float32 on its CPU accelerator). Each case runs in a fresh spawned world (its peak RSS is its own); cases are
interleaved over the repeats as in `benchmarks.suite`. dp2·tp2 runs 4 ranks on however many cores there are.

The Newton-Schulz share: the time in `engine.optimizer.matrices.orthogonalize` (wrapped on that instance here,
ZeRO's and tp's gathers of the updates included) over the step; `matrices.work` counts the rank's matrices, flops.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch.distributed as dist
from torch import nn

import benchmarks.common as common
from benchmarks.common import (
    ADAMW,
    SEED,
    LocalBatches,
    Timer,
    bench_model,
    check_same_setup,
    deepspeed_optimizer,
    innermost_optimizer,
    paratrain_optimizer,
    record_setup,
    run_case,
)
from benchmarks.suite import DOC, RESULTS, machine, summarize
from benchmarks.zero import BUCKET, DEEPSPEED_BEST, _mean_loss, _tensor_bytes
from paratrain.bench.table import write_between_markers
from paratrain.testing import World

SHAPE = dict(n_layer=2)  # bench_model with 2 of its 4 layers: the whole run in about 7 minutes on 2 cores
MICRO_BATCH = 8
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5, "ns_dtype": "bfloat16", "adjust_lr_fn": None}
AUX = {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}
HALVES = {True: ("muon", ("lr", "momentum", "weight_decay")), False: ("adamw", ("lr", "betas", "eps", "weight_decay"))}
LAYOUTS = {"DDP": ({"stage": 0}, {}), "ZeRO-1": ({"stage": 1, **BUCKET}, {}), "ZeRO-3": ({"stage": 3}, {}),
           "dp2·tp2": ({"stage": 0}, {"tensor_parallel": {"size": 2, "sequence_parallel": False}})}
BEGIN, END = "<!-- muon -->", "<!-- /muon -->"


# ---- what a case records and is checked against ---------------------------------------------------------------
def muon_setup(optimizer, model: nn.Module, batches) -> dict:
    """`record_setup` plus each half's hyper-parameters, read from the groups the optimizer built."""
    setup = record_setup(optimizer, model, batches)
    for group in innermost_optimizer(optimizer).param_groups:
        name, keys = HALVES[bool(group["use_muon"])]
        setup.setdefault("hyper", {})[name] = {k: common._plain(group.get(k)) for k in keys}
    return setup


def expected_muon_setup() -> dict:
    """What a paratrain Muon case must record: paratrain's Muon over a stand-in with the options given here."""
    from paratrain.muon import Muon

    model = nn.Linear(2, 2, dtype=common.DTYPE)
    model.init_seed = SEED
    opt = Muon([{"params": [model.weight], "use_muon": True}, {"params": [model.bias], "use_muon": False}],
               adamw=AUX, **MUON)
    return {**muon_setup(opt, model, SimpleNamespace(seed=SEED)), "threads": common.THREADS}


def _measure(timer: Timer, steps: int, step, want: dict | None) -> None:
    """Timer.measure, its setup check against `want` (a Muon case) instead of the AdamW setup."""
    if want is None:
        timer.measure(steps, step)
        return
    with mock.patch.object(common, "expected_setup", lambda: want):
        timer.measure(steps, step)


def _ns_timer(optimizer) -> list[float]:
    """Wrap this optimizer's `matrices.orthogonalize` (this instance only): the seconds of each call go to the list."""
    matrices, spent = optimizer.matrices, []
    inner = matrices.orthogonalize

    def timed(*args, **kwargs):
        tic = time.perf_counter()
        out = inner(*args, **kwargs)
        spent.append(time.perf_counter() - tic)
        return out

    matrices.orthogonalize = timed
    return spent


# ---- the cases ---------------------------------------------------------------------------------------------------
def _paratrain(layout: str, muon: bool, steps: int, warmup: int) -> dict:
    import paratrain

    zero, extra = LAYOUTS[layout]
    optimizer = {"type": "Muon", "params": {**MUON, "adamw": AUX, "muon_names": ["head.weight"]}} if muon \
        else paratrain_optimizer()
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0, "optimizer": optimizer,
           "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0}, **extra}
    model = bench_model(**SHAPE)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, engine.mesh.size("dp"), engine.mesh.local_rank("dp"))
    timer = Timer(warmup, (muon_setup if muon else record_setup)(engine.optimizer, model, batches))
    if not muon:
        _measure(timer, steps, lambda: engine.train_batch(batches), None)
        return timer.result(state_bytes=engine.memory_stats()["optimizer_state"], options=cfg)
    spent, ns, work = _ns_timer(engine.optimizer), [], engine.optimizer.matrices.work

    def step():
        first = len(spent)
        if len(ns) == warmup:
            ns.append((work.matrices, work.flops))  # the counters before the first measured step
        loss = engine.train_batch(batches)
        ns.append(sum(spent[first:]))
        return loss

    _measure(timer, steps, step, expected_muon_setup())
    before = ns.pop(warmup)
    return timer.result(state_bytes=engine.memory_stats()["optimizer_state"], options=cfg, ns_s=ns[warmup:],
                        ns_matrices=(work.matrices - before[0]) / steps, ns_flops=(work.flops - before[1]) / steps)


def _deepspeed(stage: int, muon: bool, steps: int, warmup: int) -> dict:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    optimizer = {"type": "Muon", "params": {"lr": MUON["lr"], "momentum": MUON["momentum"], "weight_decay":
                 MUON["weight_decay"], "adam_lr": AUX["lr"], "betas": AUX["betas"], "eps": AUX["eps"]}} if muon \
        else deepspeed_optimizer()
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 0.0, "optimizer": optimizer,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage, **DEEPSPEED_BEST}}
    model = bench_model(**SHAPE)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank())

    def step():
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return _mean_loss(loss)

    setup = (muon_setup if muon else record_setup)(engine.optimizer, model, batches)
    timer = Timer(warmup, setup)
    # DeepSpeed's Muon: its own class and flags; hyper-parameters, threads, dtype and seeds must be paratrain's.
    _measure(timer, steps, step, {**expected_muon_setup(), "optimizer": setup["optimizer"]} if muon else None)
    state = _tensor_bytes(v for s in innermost_optimizer(engine.optimizer).state.values() for v in s.values())
    return timer.result(state_bytes=state, options=config)


def _cases() -> dict:
    """{case: (function, world size)}: each paratrain layout with Muon and with AdamW, then DeepSpeed."""
    cases = {}
    for layout, (_, extra) in LAYOUTS.items():
        for muon in (True, False):
            cases[f"paratrain {'Muon' if muon else 'AdamW'} {layout}"] = (partial(_paratrain, layout, muon),
                                                                           4 if extra else 2)
    for stage, muon in ((1, True), (2, True), (1, False)):
        cases[f"DeepSpeed {'Muon' if muon else 'AdamW'} ZeRO-{stage}"] = (partial(_deepspeed, stage, muon), 2)
    return cases


CASES = _cases()
# Each Muon case against AdamW in the same layout (DeepSpeed: its ZeRO-1 AdamW, the anchor of both).
PEERS = {c: [c.replace("Muon", "AdamW").replace("ZeRO-2", "ZeRO-1")] for c in CASES if "Muon" in c}
BASELINE = "paratrain AdamW DDP"
PEERS["paratrain Muon ZeRO-1"].append("DeepSpeed Muon ZeRO-1")
PEERS["paratrain AdamW ZeRO-1"] = ["DeepSpeed AdamW ZeRO-1"]


# ---- the run, its checks and its summary -------------------------------------------------------------------------
def check_setups(raw: dict[str, list[list[dict]]]) -> None:
    """Every case, repeat and rank of a family recorded the same setup; every Muon case the same hyper-parameters,
    threads, dtype and seeds (paratrain's and DeepSpeed's Muon differ in class and flags only)."""
    records = {f"{case} (repeat {r + 1}, rank {k})": rank["setup"]
               for case, runs in raw.items() for r, ranks in enumerate(runs) for k, rank in enumerate(ranks)}
    for family in ("paratrain Muon", "DeepSpeed Muon", "AdamW"):
        check_same_setup({name: setup for name, setup in records.items() if family in name})
    check_same_setup({name: {k: setup.get(k) for k in ("hyper", "threads", "dtype", "seed")}
                      for name, setup in records.items() if "Muon" in name})


def newton_schulz_summary(runs: list[list[dict]]) -> dict:
    """The share of the step spent orthogonalizing (the largest rank's, median over repeats) and the work per rank."""
    shares = [max(sum(r["ns_s"]) / sum(r["step_times"]) for r in ranks) for ranks in runs]
    return {"ns_share": statistics.median(shares), "ns_share_per_repeat": shares,
            "ns_matrices_per_rank": [r["ns_matrices"] for r in runs[0]],
            "ns_gflop_per_rank": [r["ns_flops"] / 1e9 for r in runs[0]]}


def run(repeats: int, steps: int, warmup: int) -> dict:
    raw: dict[str, list[list[dict]]] = {case: [] for case in CASES}
    start = time.time()
    for r in range(repeats):
        for case, (fn, world_size) in CASES.items():
            print(f"[muon] repeat {r + 1}/{repeats}: {case}", file=sys.stderr, flush=True)
            with World(world_size, timeout_s=900) as world:
                raw[case].append(world.run(run_case, case, fn, steps, warmup))
    check_setups(raw)
    summary = summarize(raw, BASELINE, PEERS)
    for case, runs in raw.items():
        if "ns_s" in runs[0][0]:
            summary[case].update(newton_schulz_summary(runs))
    return {"suite": "muon", "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(start)),
            "wall_s": time.time() - start, "repeats": repeats, "steps": steps, "warmup": warmup,
            "model": {**common.BENCH_MODEL, **SHAPE}, "micro_batch": MICRO_BATCH, "muon": MUON, "adamw_part": AUX,
            "baseline": BASELINE, "peers": PEERS, "setup": {case: runs[0][0]["setup"] for case, runs in raw.items()},
            "summary": summary, "raw": raw}


def table(result: dict) -> str:
    head = ["case", "ranks", "median step (ms)", "ratio to peers", "peak RSS / rank (MiB)",
            "optimizer state / rank (MiB)", "last loss", "Newton-Schulz share of the step",
            "NS matrices / rank / step", "NS GFLOP / rank / step", "per-repeat medians (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for case, row in result["summary"].items():
        repeats = [statistics.median(map(max, zip(*(r["step_times"] for r in ranks)))) for ranks in result["raw"][case]]
        peers = ", ".join(f"{r:.3f} vs {p}" for p, r in row.get("peer_ratios", {}).items()) or "—"
        ns = [f"{row['ns_share']:.1%}", " / ".join(f"{m:g}" for m in row["ns_matrices_per_rank"]),
              " / ".join(f"{g:.2f}" for g in row["ns_gflop_per_rank"])] if "ns_share" in row else ["—"] * 3
        lines.append(f"| {case} | {CASES[case][1]} | {row['median_step_s'] * 1e3:.1f} | {peers} | "
                     f"{row['peak_rss_mib']:.0f} | {row['state_mib']:.2f} | {row['last_loss']:.5f} | "
                     + " | ".join(ns) + f" | {', '.join(f'{t * 1e3:.0f}' for t in repeats)} |")
    return "\n".join(lines)


def section(result: dict, command: str) -> str:
    m = result["model"]
    return (f"### muon\n\nMeasured {result['started']} on {result['machine']}; the whole run took "
            f"{result['wall_s'] / 60:.1f} min.\n\nCommand: `{command}`\n\n"
            f"paratrain's Muon against paratrain's AdamW in the same layout (DDP, ZeRO-1, ZeRO-3 on dp2; dp2·tp2 on "
            f"4 ranks, which share the 2 cores of this machine: oversubscribed), and DeepSpeed 0.19.8's Muon at "
            f"ZeRO-1 and ZeRO-2 against DeepSpeed's AdamW at ZeRO-1. GPT {m['n_layer']} layers, d_model "
            f"{m['d_model']}, {m['n_head']} heads, sequence {m['seq_len']}, micro-batch {result['micro_batch']} per dp "
            f"rank, fp32, no clipping, same seed and batches; Muon lr {MUON['lr']}, momentum {MUON['momentum']}, "
            f"{MUON['ns_steps']} Newton-Schulz steps in bfloat16 (DeepSpeed: its Gram iteration in float32 on CPU), "
            f"on the hidden matrices and the head; AdamW (lr {AUX['lr']}, betas {tuple(AUX['betas'])}) on the rest. "
            f"{result['repeats']} interleaved repeats x {result['steps']} measured steps after {result['warmup']} "
            f"warm-up, each case in a fresh world; a step's time is its slowest rank's. Ratios are this row's median "
            f"step over the named case's. Every case records what it built (`record_setup` and each half's "
            f"hyper-parameters): the AdamW cases must match the suites' setup, paratrain's Muon cases paratrain's Muon "
            f"with these options, DeepSpeed's Muon cases its hyper-parameters, threads, dtype and seeds. Optimizer "
            f"state is `engine.memory_stats()['optimizer_state']` (DeepSpeed: its optimizer's state tensors); the "
            f"Newton-Schulz share is the time in `matrices.orthogonalize` (with ZeRO's gather and reduce-scatter of "
            f"the updates and tp's gathers) over the step, the largest rank's; NS matrices and GFLOP per rank per "
            f"step come from `matrices.work` (rank 0 / rank 1 / ...). This machine is shared and noisy: compare the "
            f"per-repeat medians before reading a ratio. Raw step times, "
            f"setups and per-repeat shares: `benchmarks/results/muon.json`.\n\n{table(result)}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-doc", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where muon.json goes")
    parser.add_argument("--render", type=Path, help="run nothing: write the doc from this muon.json")
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        result = run(args.repeats, args.steps, args.warmup)
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "muon.json").write_text(json.dumps(result, indent=1))
    command = f"python -m benchmarks.muon --repeats {result['repeats']} --steps {result['steps']} " \
              f"--warmup {result['warmup']}"
    print(section(result, command))
    if not args.no_doc:
        write_between_markers(DOC, section(result, command), BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())

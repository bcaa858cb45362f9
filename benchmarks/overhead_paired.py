"""The overhead suite's ratios to the peers, measured in pairs inside one world, step by step.

The suite (`benchmarks/overhead.py`) runs every case in a world of its own and compares medians over repeats;
on these shared 2-core machines the peers' own steps moved between 57 and 94 ms from run to run, more than the
ratios differ. Here each rank builds both cases of a pair (paratrain and its peer, each exactly as the suite
builds it, the setup checked the same way) on the same processes, and then alternates their steps, the order
flipped every step, a barrier before each; a pair's ratio is the median over steps of (paratrain's step /
the peer's step in the same round), so a slow moment of the machine hits both sides of a round alike. A
step's time is its slowest rank's.

    python -m benchmarks.overhead_paired --rounds 40 --warmup 5
    python -m benchmarks.overhead_paired --suite peft --rounds 20 --warmup 3

writes benchmarks/results/<suite>_paired.json (overhead_paired.json, peft_paired.json) and prints the ratios:
every pair of the suite's PEERS (the overhead suite's one-unit pair left out). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from pathlib import Path

import torch.distributed as dist

import benchmarks.common as common
from paratrain.testing import World

RESULTS = Path(__file__).resolve().parent / "results"


def pairs_of(suite: str) -> list[tuple[str, str]]:
    """(paratrain's case, its peer) for every peer the suite names."""
    peers = importlib.import_module(f"benchmarks.{suite}").PEERS
    return [(ours, peer) for ours, named in peers.items() for peer in ([named] if isinstance(named, str) else named)
            if "one unit" not in ours]


def _step_of(suite: str, case: str):
    fn, _ = importlib.import_module(f"benchmarks.{suite}").CASES[case]
    common.CURRENT_CASE, common.STEP_SINK = case, []
    try:
        fn(0, 0)  # builds the case, checks its setup, hands its step over
        return common.STEP_SINK[0]
    finally:
        common.STEP_SINK = None


def _pair(suite: str, ours: str, peer: str, rounds: int, warmup: int) -> dict:
    steps = {ours: _step_of(suite, ours), peer: _step_of(suite, peer)}
    times: dict[str, list[float]] = {ours: [], peer: []}
    losses: dict[str, list[float]] = {ours: [], peer: []}
    for i in range(warmup + rounds):
        for name in ((ours, peer) if i % 2 == 0 else (peer, ours)):
            dist.barrier()
            tic = time.perf_counter()
            loss = steps[name]()
            elapsed = time.perf_counter() - tic
            losses[name].append(float(loss))
            if i >= warmup:
                times[name].append(elapsed)
    return {"times": times, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--suite", default="overhead", help="the suite whose pairs run (overhead, peft)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as benchmarks.suite sets it (the DeepSpeed peers)
    out = {"suite": args.suite, "rounds": args.rounds, "warmup": args.warmup,
           "load_average": {"start": os.getloadavg()}, "pairs": {}}
    for ours, peer in pairs_of(args.suite):
        with World(2, timeout_s=1800) as world:
            ranks = world.run(_pair, args.suite, ours, peer, args.rounds, args.warmup)
        slowest = {name: [max(t) for t in zip(*(r["times"][name] for r in ranks))] for name in (ours, peer)}
        ratios = [a / b for a, b in zip(slowest[ours], slowest[peer])]
        out["pairs"][f"{ours} / {peer}"] = {
            "median_ratio": statistics.median(ratios), "ratios": ratios, "step_times": slowest,
            "median_step_s": {name: statistics.median(t) for name, t in slowest.items()},
            "same_losses_to_1e-5": all(abs(a - b) <= 1e-5 * abs(b) for a, b in
                                       zip(ranks[0]["losses"][ours], ranks[0]["losses"][peer]))}
        print(f"{ours} / {peer}: median ratio {out['pairs'][f'{ours} / {peer}']['median_ratio']:.3f}", flush=True)
    out["load_average"]["end"] = os.getloadavg()
    (RESULTS / f"{args.suite}_paired.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

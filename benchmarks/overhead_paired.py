"""The overhead suite's ratios to the peers, measured in pairs inside one world, step by step.

The suite (`benchmarks/overhead.py`) runs every case in a world of its own and compares medians over repeats;
on these shared 2-core machines the peers' own steps moved between 57 and 94 ms from run to run, more than the
ratios differ. Here each rank builds both cases of a pair (paratrain and its peer, each exactly as the suite
builds it, the setup checked the same way) on the same processes, and then alternates their steps, the order
flipped every step, a barrier before each; a pair's ratio is the median over steps of (paratrain's step /
the peer's step in the same round), so a slow moment of the machine hits both sides of a round alike. A
step's time is its slowest rank's.

    python -m benchmarks.overhead_paired --rounds 40 --warmup 5

writes benchmarks/results/overhead_paired.json and prints the ratios. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist

import benchmarks.common as common
from benchmarks.overhead import CASES, PEERS
from paratrain.testing import World

RESULTS = Path(__file__).resolve().parent / "results" / "overhead_paired.json"
PAIRS = [(ours, peer) for ours, peer in PEERS.items() if "one unit" not in ours]


def _step_of(case: str):
    fn, _ = CASES[case]
    common.CURRENT_CASE, common.STEP_SINK = case, []
    try:
        fn(0, 0)  # builds the case, checks its setup, hands its step over
        return common.STEP_SINK[0]
    finally:
        common.STEP_SINK = None


def _pair(ours: str, peer: str, rounds: int, warmup: int) -> dict:
    steps = {ours: _step_of(ours), peer: _step_of(peer)}
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
    args = parser.parse_args(argv)
    out = {"rounds": args.rounds, "warmup": args.warmup, "pairs": {}}
    for ours, peer in PAIRS:
        with World(2, timeout_s=1800) as world:
            ranks = world.run(_pair, ours, peer, args.rounds, args.warmup)
        slowest = {name: [max(t) for t in zip(*(r["times"][name] for r in ranks))] for name in (ours, peer)}
        ratios = [a / b for a, b in zip(slowest[ours], slowest[peer])]
        out["pairs"][f"{ours} / {peer}"] = {
            "median_ratio": statistics.median(ratios), "ratios": ratios, "step_times": slowest,
            "median_step_s": {name: statistics.median(t) for name, t in slowest.items()},
            "same_losses_to_1e-5": all(abs(a - b) <= 1e-5 * abs(b) for a, b in
                                       zip(ranks[0]["losses"][ours], ranks[0]["losses"][peer]))}
        print(f"{ours} / {peer}: median ratio {out['pairs'][f'{ours} / {peer}']['median_ratio']:.3f}", flush=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

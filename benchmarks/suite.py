"""Run side-by-side benchmark suites and write their tables into docs/benchmarks.md.

    python -m benchmarks.suite                      # every suite
    python -m benchmarks.suite --only ddp --repeats 5 --steps 20

Each case runs in a fresh spawned world (so its peak RSS is its own); cases of a suite are interleaved
(A B A B ...) so slow drifts of this noisy machine hit every case alike. Reported: the median over repeats
of the median step time (a step's time is its slowest rank's), the ratio to the suite's baseline, the
peak RSS of the largest rank, model-state bytes per rank, and the last loss of each case.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from paratrain.testing import World

SUITES = ["ddp", "zero", "tp", "pp", "cp"]
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
            f"gloo on CPU, one thread per rank")


def run_suite(name: str, repeats: int, steps: int, warmup: int) -> dict:
    module = importlib.import_module(f"benchmarks.{name}")
    raw: dict[str, list[list[dict]]] = {case: [] for case in module.CASES}
    for r in range(repeats):
        for case, (fn, world_size) in module.CASES.items():
            print(f"[{name}] repeat {r + 1}/{repeats}: {case}", file=sys.stderr, flush=True)
            with World(world_size, timeout_s=900) as world:
                raw[case].append(world.run(fn, steps, warmup))
    baseline_of = getattr(module, "BASELINE_OF", {})
    return {"suite": name, "baseline": module.BASELINE, "baseline_of": baseline_of, "repeats": repeats,
            "steps": steps, "raw": raw, "summary": summarize(raw, module.BASELINE, baseline_of)}


def summarize(raw: dict[str, list[list[dict]]], baseline: str,
              baseline_of: dict[str, str] | None = None) -> dict[str, dict]:
    """Per case: medians, and the ratio to its baseline (`baseline_of[case]`, else the suite's)."""
    out = {}
    for case, runs in raw.items():
        medians = []
        for ranks in runs:
            slowest = [max(step) for step in zip(*(r["step_times"] for r in ranks))]
            medians.append(statistics.median(slowest))
        out[case] = {"median_step_s": statistics.median(medians),
                     "peak_rss_mib": statistics.median(max(r["peak_rss"] for r in ranks) for ranks in runs) / 2**20,
                     "state_mib": max(r["state_bytes"] for r in runs[0]) / 2**20,
                     "last_loss": runs[0][0]["losses"][-1]}
        out[case].update({k: v for k, v in runs[0][0].items() if k.startswith("extra_")})
    for case, row in out.items():
        row["baseline"] = (baseline_of or {}).get(case, baseline)
        row["ratio"] = row["median_step_s"] / out[row["baseline"]]["median_step_s"]
    return out


def table(result: dict) -> str:
    others = sorted(set(result.get("baseline_of", {}).values()) - {result["baseline"]})
    also = f" (ratios of the cases {', '.join(k for k in result.get('baseline_of', {}))} are to " \
        f"{', '.join(others)})" if others else ""
    lines = [f"Baseline: **{result['baseline']}**{also}; {result['repeats']} interleaved repeats x "
             f"{result['steps']} measured steps.", "",
             "| case | median step (ms) | ratio to baseline | peak RSS / rank (MiB) | model state / rank (MiB) "
             "| last loss |", "|---|---:|---:|---:|---:|---:|"]
    for case, row in result["summary"].items():
        lines.append(f"| {case} | {row['median_step_s'] * 1e3:.1f} | {row['ratio']:.3f} | "
                     f"{row['peak_rss_mib']:.0f} | {row['state_mib']:.2f} | {row['last_loss']:.5f} |")
    return "\n".join(lines)


def write_doc(name: str, body: str, command: str) -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    stamp = time.strftime("%Y-%m-%d")
    section = (f"<!-- suite:{name} -->\n### {name}\n\nMeasured {stamp} on {machine()}.\n\nCommand: `{command}`\n\n"
               f"{body}\n<!-- /suite:{name} -->")
    pattern = re.compile(rf"<!-- suite:{name} -->.*?<!-- /suite:{name} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SUITES), help="comma-separated suites: " + ", ".join(SUITES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-doc", action="store_true", help="print tables, do not touch docs/benchmarks.md")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        result = run_suite(name, args.repeats, args.steps, args.warmup)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
        body = table(result)
        print(f"\n## {name}\n{body}\n")
        if not args.no_doc:
            command = (f"python -m benchmarks.suite --only {name} --repeats {args.repeats} --steps {args.steps} "
                       f"--warmup {args.warmup}")
            write_doc(name, body, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

SUITES = ["ddp", "zero", "tp", "pp"]
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
    return {"suite": name, "baseline": module.BASELINE, "repeats": repeats, "steps": steps, "raw": raw,
            "summary": summarize(raw, module.BASELINE, getattr(module, "PEERS", None))}


def summarize(raw: dict[str, list[list[dict]]], baseline: str, peers: dict[str, str] | None = None) -> dict[str, dict]:
    """Per case: medians, the ratio to the suite's baseline and, when the suite names one (PEERS), the ratio
    to the case's own peer; `extra_*` measurements of rank 0 are carried along as extra columns."""
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
    base = out[baseline]["median_step_s"]
    for case, row in out.items():
        row["ratio"] = row["median_step_s"] / base
        if peers and case in peers and peers[case] in out:
            row["peer"] = peers[case]
            row["ratio_to_peer"] = row["median_step_s"] / out[peers[case]]["median_step_s"]
    return out


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return " / ".join(_cell(v) for v in value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(result: dict) -> str:
    rows = result["summary"]
    peers = any("peer" in row for row in rows.values())
    extras = sorted({k for row in rows.values() for k in row if k.startswith("extra_")})
    head = "| case | median step (ms) | ratio to baseline | " + ("ratio to peer (peer) | " if peers else "") + \
        "peak RSS / rank (MiB) | model state / rank (MiB) | last loss |" + \
        "".join(f" {k.removeprefix('extra_').replace('_', ' ')} |" for k in extras)
    lines = [f"Baseline: **{result['baseline']}**; {result['repeats']} interleaved repeats x {result['steps']} "
             f"measured steps.", "", head, "|---|---:|---:|" + ("---:|" if peers else "") + "---:|---:|---:|" +
             "---:|" * len(extras)]
    for case, row in rows.items():
        peer = f"{row['ratio_to_peer']:.3f} ({row['peer']}) | " if "peer" in row else ("— | " if peers else "")
        lines.append(f"| {case} | {row['median_step_s'] * 1e3:.1f} | {row['ratio']:.3f} | {peer}"
                     f"{row['peak_rss_mib']:.0f} | {row['state_mib']:.2f} | {row['last_loss']:.5f} |" +
                     "".join(f" {_cell(row.get(k))} |" for k in extras))
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

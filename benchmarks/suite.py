"""Run side-by-side benchmark suites and write their tables into docs/benchmarks.md.

    python -m benchmarks.suite                      # every suite
    python -m benchmarks.suite --only ddp --repeats 5 --steps 20

Each case runs in a fresh spawned world (so its peak RSS is its own); cases of a suite are interleaved
(A B A B ...) so slow drifts of this noisy machine hit every case alike. Every case records what it built
(optimizer class and flags, threads, dtype, seeds; `benchmarks.common.record_setup`) and refuses to time
itself unless that is the common setup; the suite checks the records of all cases, repeats and ranks against
each other before it compares anything, and writes them into the result JSON. Reported: the median over repeats
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

from benchmarks.common import check_same_setup, run_case
from paratrain.testing import World

SUITES = ["ddp", "zero", "tp", "pp", "cp", "ckpt", "cp_methods", "v_schedules", "overhead", "peft"]
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
    load_at_start = os.getloadavg()
    raw: dict[str, list[list[dict]]] = {case: [] for case in module.CASES}
    for r in range(repeats):
        for case, (fn, world_size) in module.CASES.items():
            print(f"[{name}] repeat {r + 1}/{repeats}: {case}", file=sys.stderr, flush=True)
            with World(world_size, timeout_s=900) as world:
                raw[case].append(world.run(run_case, case, fn, steps, warmup))
    check_same_setup({f"{case} (repeat {r + 1}, rank {k})": rank.get("setup")
                      for case, runs in raw.items() for r, ranks in enumerate(runs) for k, rank in enumerate(ranks)})
    peers, reference = getattr(module, "PEERS", None), getattr(module, "REFERENCE", None)
    return {"suite": name, "baseline": module.BASELINE, "repeats": repeats, "steps": steps,
            "setup": {case: runs[0][0]["setup"] for case, runs in raw.items()}, "raw": raw,
            "peers": peers, "reference": reference,
            # the machine's 1/5/15-minute load averages (other users' jobs share these cores), and the suite's note
            "load_average": {"start": load_at_start, "end": os.getloadavg()}, "note": getattr(module, "NOTE", None),
            "summary": summarize(raw, module.BASELINE, peers, reference)}


def summarize(raw: dict[str, list[list[dict]]], baseline: str, peers: dict[str, list[str]] | None = None,
              reference: str | None = None) -> dict[str, dict]:
    """Per case: median step time, its ratio to the baseline and (optional) to each of its peers, peak RSS,
    model state, last loss and (optional) the largest per-step loss difference to the reference case."""
    out = {}
    for case, runs in raw.items():
        medians = []
        for ranks in runs:
            slowest = [max(step) for step in zip(*(r["step_times"] for r in ranks))]
            medians.append(statistics.median(slowest))
        out[case] = {"median_step_s": statistics.median(medians), "repeat_median_step_s": medians,
                     "peak_rss_mib": statistics.median(max(r["peak_rss"] for r in ranks) for ranks in runs) / 2**20,
                     "state_mib": max(r["state_bytes"] for r in runs[0]) / 2**20,
                     "last_loss": runs[0][0]["losses"][-1]}
        out[case].update({k: v for k, v in runs[0][0].items() if k.startswith("extra_")})
    base = out[baseline]["median_step_s"]
    for row in out.values():
        row["ratio"] = row["median_step_s"] / base
    for case, others in (peers or {}).items():
        others = [others] if isinstance(others, str) else others
        out[case]["peer_ratios"] = {p: out[case]["median_step_s"] / out[p]["median_step_s"] for p in others}
        out[case]["peer_ratios_per_repeat"] = {  # repeat r of the case against repeat r of the peer
            p: [a / b for a, b in zip(out[case]["repeat_median_step_s"], out[p]["repeat_median_step_s"])]
            for p in others}
    if reference is not None:
        want = raw[reference][0][0]["losses"]
        for case, runs in raw.items():
            got = runs[0][0]["losses"]
            out[case]["loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return out


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return " / ".join(_cell(v) for v in value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(result: dict) -> str:
    """The markdown table; suites with PEERS / REFERENCE get a peer-ratio / loss-difference column, and
    `extra_*` measurements (e.g. pipeline bubbles) get a column each."""
    peers, reference = result.get("peers"), result.get("reference")
    rows = result["summary"]
    extras = sorted({k for row in rows.values() for k in row if k.startswith("extra_")})
    head = ["case", "median step (ms)", "ratio to baseline"] + (["ratio to peers"] if peers else []) + \
        ["peak RSS / rank (MiB)", "model state / rank (MiB)", "last loss"] + \
        (["max loss diff vs reference"] if reference else []) + \
        [k.removeprefix("extra_").replace("_", " ") for k in extras]
    lines = [f"Baseline: **{result['baseline']}**; {result['repeats']} interleaved repeats x {result['steps']} "
             f"measured steps.", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for case, row in rows.items():
        cells = [case, f"{row['median_step_s'] * 1e3:.1f}", f"{row['ratio']:.3f}"]
        if peers:
            per_repeat = row.get("peer_ratios_per_repeat", {})
            cells.append(", ".join(f"{r:.3f} ({' / '.join(f'{x:.2f}' for x in per_repeat.get(p, []))} per repeat) "
                                   f"vs {p}" if per_repeat.get(p) else f"{r:.3f} vs {p}"
                                   for p, r in row.get("peer_ratios", {}).items()) or "—")
        cells += [f"{row['peak_rss_mib']:.0f}", f"{row['state_mib']:.2f}", f"{row['last_loss']:.5f}"]
        if reference:
            cells.append(f"{row['loss_diff']:.1e}")
        cells += [_cell(row.get(k)) for k in extras]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(name: str, body: str, command: str, measured: str | None = None) -> None:
    """Write suite `name`'s section of docs/benchmarks.md (`measured`: the date the numbers were taken, when not
    today)."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    stamp = measured or time.strftime("%Y-%m-%d")
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
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where the result JSON goes (a smoke run: a temporary folder, and --no-doc)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.results.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        result = run_suite(name, args.repeats, args.steps, args.warmup)
        (args.results / f"{name}.json").write_text(json.dumps(result, indent=1))
        body = table(result)
        print(f"\n## {name}\n{body}\n")
        if not args.no_doc:
            command = (f"python -m benchmarks.suite --only {name} --repeats {args.repeats} --steps {args.steps} "
                       f"--warmup {args.warmup}")
            write_doc(name, body, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())

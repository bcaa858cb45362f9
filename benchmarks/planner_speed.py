"""How long `paratrain plan` takes to answer, per cluster size, on this tree and on an earlier commit.

    python -m benchmarks.planner_speed --side before --ref 4cc61fb --timeout 600
    python -m benchmarks.planner_speed --side after --repeats 3
    python -m benchmarks.planner_speed --side both --ref 878c21a --repeats 3   # alternating, one load

Each run is the CLI a user types, `paratrain plan --model llama3-70b --gpus N --gpu-memory 80GiB --json`, in a fresh
interpreter (imports included), timed from outside by wall clock; a run past `--timeout` is killed and recorded as
such (`timed_out`, its time the timeout); with `--repeats` the fastest run is the record. `before` runs a `git
archive` of `--ref` (the planner as it was), `after` this tree. Each side is written into
benchmarks/results/planner_speed.json next to the other side's earlier record, with the load average around every
run (the machine is shared: a loaded machine shows). Where both sides answered, the table's `same answer` says
whether their JSON (layouts considered and fitting, the ranked layouts and every number) is equal (sha256). Nothing
here asserts a time; docs/planner.md quotes the table this prints. A side measured on another commit than its
record's moves that record under `earlier`, by commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "planner_speed.json"
MODEL, MEMORY = "llama3-70b", "80GiB"
CLI = "import sys; from paratrain.cli import main; sys.exit(main())"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def time_plan(tree: Path, gpus: int, timeout: float) -> dict:
    """One `paratrain plan` in a fresh interpreter on `tree`'s paratrain: wall seconds, and its answer's digest."""
    command = [sys.executable, "-c", CLI, "plan", "--model", MODEL, "--gpus", str(gpus), "--gpu-memory", MEMORY,
               "--json"]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    load_before, start = os.getloadavg(), time.perf_counter()
    try:
        run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"gpus": gpus, "seconds": timeout, "timed_out": True, "load_before": load_before,
                "load_after": os.getloadavg()}
    seconds = time.perf_counter() - start
    if run.returncode not in (0, 1):
        raise RuntimeError(f"paratrain plan --gpus {gpus} failed in {tree}:\n{run.stderr[-3000:]}")
    answer = json.loads(run.stdout)
    return {"gpus": gpus, "seconds": seconds, "timed_out": False, "load_before": load_before,
            "load_after": os.getloadavg(), "considered": answer["considered"], "fit": answer["fit"],
            "best": answer["ranked"][0]["layout"] if answer["ranked"] else None,
            "answer_sha256": hashlib.sha256(run.stdout.encode()).hexdigest()}


def best_of(tree: Path, gpus: int, timeout: float, repeats: int) -> dict:
    """The fastest of `repeats` runs (the one least disturbed by the machine's other work), with every run's
    seconds and load averages."""
    runs = [time_plan(tree, gpus, timeout) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["seconds"])
    if repeats > 1:
        best = {**best, "repeats": [{k: r[k] for k in ("seconds", "load_before", "load_after")} for r in runs]}
    return best


def tree_of(side: str, ref: str, scratch: str) -> tuple[str, Path]:
    """(commit, the tree whose paratrain that side runs): `ref` as a `git archive` for 'before', this tree after."""
    commit = _git("rev-parse", ref if side == "before" else "HEAD")
    if side == "after":
        return commit, ROOT
    archive = Path(scratch) / "tree.tar"
    _git("archive", "--format=tar", "-o", str(archive), commit)
    tree = Path(scratch) / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return commit, tree


def record(side: str, commit: str, timeout: float, runs: list[dict]) -> dict:
    dirty = side == "after" and bool(_git("status", "--porcelain", "--", "paratrain"))
    return {"commit": commit, "tree_dirty": dirty, "timeout_s": timeout, "runs": runs,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def measure(side: str, ref: str, sizes: list[int], timeout: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="planner_speed_") as scratch:
        commit, tree = tree_of(side, ref, scratch)
        runs = []
        for gpus in sizes:
            runs.append(best_of(tree, gpus, timeout, repeats))
            print(f"{side} {gpus} GPUs: {runs[-1]['seconds']:.1f} s" + (" (timed out)" if runs[-1]["timed_out"]
                                                                          else ""), file=sys.stderr, flush=True)
    return record(side, commit, timeout, runs)


def measure_pair(ref: str, sizes: list[int], timeout: float, repeats: int) -> tuple[dict, dict]:
    """Both sides in one run, alternating run by run (before, after, before, ...) for each size, so that both see
    the same load; each side's record keeps its fastest run and every run's seconds and load."""
    with tempfile.TemporaryDirectory(prefix="planner_speed_") as scratch:
        (before_commit, before_tree), (after_commit, after_tree) = tree_of("before", ref, scratch), \
            tree_of("after", ref, scratch)
        sides: dict[str, list[dict]] = {"before": [], "after": []}
        for gpus in sizes:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(repeats):
                for side, tree in (("before", before_tree), ("after", after_tree)):
                    runs[side].append(time_plan(tree, gpus, timeout))
            for side, measured in runs.items():
                best = min(measured, key=lambda r: r["seconds"])
                sides[side].append({**best, "repeats": [{k: r[k] for k in ("seconds", "load_before", "load_after")}
                                                        for r in measured]})
            print(f"{gpus} GPUs: before {sides['before'][-1]['seconds']:.2f} s, after "
                  f"{sides['after'][-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    return record("before", before_commit, timeout, sides["before"]), \
        record("after", after_commit, timeout, sides["after"])


def table(result: dict) -> str:
    """The docs' table: seconds per cluster size, before and after, and whether the answers are equal."""
    before = {r["gpus"]: r for r in result.get("before", {}).get("runs", [])}
    after = {r["gpus"]: r for r in result.get("after", {}).get("runs", [])}
    lines = ["| GPUs | layouts considered | fit in 80 GiB | before (s) | after (s) | same answer |",
             "|---:|---:|---:|---:|---:|---|"]
    for gpus in sorted(set(before) | set(after)):
        b, a = before.get(gpus), after.get(gpus)
        known = a if a and not a["timed_out"] else b
        old = "—" if b is None else (f"> {b['seconds']:.0f} (killed)" if b["timed_out"] else f"{b['seconds']:.1f}")
        new = "—" if a is None else (f"> {a['seconds']:.0f} (killed)" if a["timed_out"] else f"{a['seconds']:.2f}")
        same = "—" if not (a and b) or a["timed_out"] or b["timed_out"] else \
            ("yes" if a["answer_sha256"] == b["answer_sha256"] else "NO")
        considered = known.get("considered", "—") if known else "—"
        fit = known.get("fit", "—") if known else "—"
        lines.append(f"| {gpus} | {considered} | {fit} | {old} | {new} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["before", "after", "both"], required=True,
                        help="both: the two sides alternating run by run in one invocation")
    parser.add_argument("--ref", default="4cc61fb", help="the commit `before` runs (the planner before the change)")
    parser.add_argument("--gpus", default="8,64,256,1024", help="comma-separated cluster sizes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds after which a run is killed")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size; the fastest is recorded")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = json.loads(args.results.read_text()) if args.results.exists() else {}
    result.update({"model": MODEL, "gpu_memory": MEMORY, "cpu": platform.processor() or platform.machine(),
                   "cores": os.cpu_count()})
    sizes = [int(g) for g in args.gpus.split(",")]
    if args.side == "both":
        measured = dict(zip(("before", "after"), measure_pair(args.ref, sizes, args.timeout, args.repeats)))
    else:
        measured = {args.side: measure(args.side, args.ref, sizes, args.timeout, args.repeats)}
    for name, side in measured.items():
        earlier = result.get(name, {})
        if earlier.get("commit") not in (None, side["commit"]):  # another tree's record: kept, not overwritten
            result.setdefault("earlier", {})[earlier["commit"][:7]] = earlier
        elif earlier.get("commit") == side["commit"]:  # a rerun of some sizes replaces those and keeps the others
            done = {r["gpus"] for r in side["runs"]}
            side["runs"] = sorted([r for r in earlier["runs"] if r["gpus"] not in done] + side["runs"],
                                  key=lambda r: r["gpus"])
        for run in side["runs"]:
            run.setdefault("command", "python -m benchmarks.planner_speed " + " ".join(
                sys.argv[1:] if argv is None else argv))
        result[name] = side
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

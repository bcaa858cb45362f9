"""Step time of paratrain's own cases against an earlier commit of paratrain, in one interleaved run.

    python -m benchmarks.versus_commit dfce74f --only ddp,zero --repeats 3 --steps 10 --warmup 2

A refactor must not make a step slower. This checks out `ref` into a scratch worktree, copies the current
`benchmarks/` into it (so both sides run the same benchmark code, the same model, data and optimizer, and only
the library differs), and then alternates: every paratrain case of the chosen suites on the old tree, then on
this one, `repeats` times (A B A B ...), each case in a fresh spawned world of its own subprocess. Peers are not
run: they do not change between the two trees. Writes benchmarks/results/versus_commit.json (raw step times,
the medians, the ratio this tree / `ref` per case) and prints the table. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "versus_commit.json"

# Runs inside one tree (its paratrain on sys.path first): every paratrain case of the suites, one world each.
_DRIVER = """
import importlib, json, sys
from benchmarks.common import run_case
from paratrain.testing import World
suites, steps, warmup = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
out = {}
for suite in suites:
    for case, (fn, world_size) in importlib.import_module(f"benchmarks.{suite}").CASES.items():
        if case.startswith("paratrain"):
            try:  # a case for an option the other tree does not have fails there: it is left out of the table
                with World(world_size, timeout_s=900) as world:
                    ranks = world.run(run_case, case, fn, steps, warmup)
            except Exception as exc:
                out[f"{suite}: {case}"] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
                continue
            out[f"{suite}: {case}"] = {"step_times": [max(s) for s in zip(*(r["step_times"] for r in ranks))],
                                       "losses": ranks[0]["losses"]}
print("RESULT " + json.dumps(out))
"""


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _run_tree(tree: Path, suites: str, steps: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, "-c", _DRIVER, suites, str(steps), str(warmup)], cwd=tree, env=env,
                         capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"the cases failed in {tree}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def compare(ref: str, suites: str, repeats: int, steps: int, warmup: int) -> dict:
    old_commit, new_commit = _git("rev-parse", ref), _git("rev-parse", "HEAD")
    scratch = Path(tempfile.mkdtemp(prefix="versus_commit_"))
    old_tree = scratch / "tree"
    _git("worktree", "add", "--detach", str(old_tree), old_commit)
    try:
        shutil.rmtree(old_tree / "benchmarks")
        shutil.copytree(ROOT / "benchmarks", old_tree / "benchmarks", ignore=shutil.ignore_patterns("results"))
        raw: dict[str, dict[str, list]] = {"old": {}, "new": {}}
        for r in range(repeats):
            for side, tree in (("old", old_tree), ("new", ROOT)):
                print(f"repeat {r + 1}/{repeats}: {side} ({tree})", file=sys.stderr, flush=True)
                for case, record in _run_tree(tree, suites, steps, warmup).items():
                    raw[side].setdefault(case, []).append(record)
    finally:
        _git("worktree", "remove", "--force", str(old_tree))
        shutil.rmtree(scratch, ignore_errors=True)
    summary, left_out = {}, {}
    for case, runs in raw["new"].items():
        errors = [run["error"] for side in ("old", "new") for run in raw[side].get(case, []) if "error" in run]
        if errors or case not in raw["old"]:
            left_out[case] = errors[0] if errors else "not a case of the other tree"
            continue
        medians = {side: statistics.median(statistics.median(run["step_times"]) for run in raw[side][case])
                   for side in ("old", "new")}
        summary[case] = {"old_median_step_s": medians["old"], "new_median_step_s": medians["new"],
                         "ratio_new_to_old": medians["new"] / medians["old"],
                         "same_losses": raw["old"][case][0]["losses"] == runs[0]["losses"]}
    return {"ref": old_commit, "head": new_commit, "suites": suites, "repeats": repeats, "steps": steps,
            "warmup": warmup, "raw": raw, "summary": summary, "left_out": left_out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="the earlier commit to compare with")
    parser.add_argument("--only", default="ddp,zero", help="comma-separated suites (their paratrain cases run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = compare(args.ref, args.only, args.repeats, args.steps, args.warmup)
    result["command"] = "python -m benchmarks.versus_commit " + " ".join(sys.argv[1:] if argv is None else argv)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(f"| case | {result['ref'][:7]} (ms) | {result['head'][:7]} (ms) | ratio | same losses |")
    print("|---|---:|---:|---:|---|")
    for case, row in result["summary"].items():
        print(f"| {case} | {row['old_median_step_s'] * 1e3:.1f} | {row['new_median_step_s'] * 1e3:.1f} | "
              f"{row['ratio_new_to_old']:.3f} | {row['same_losses']} |")
    for case, why in result["left_out"].items():
        print(f"left out: {case}: {why[:160]}")


if __name__ == "__main__":
    main()

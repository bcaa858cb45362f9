"""A successful `paratrain train` start, with the failure reporting (paratrain.failure) against the commit before it.

    python -m benchmarks.failure_startup 4cc61fb --repeats 5

Reporting a failure once must cost a run that does not fail nothing: its hook is installed at start-up, the
launcher calls torchrun's `run` instead of its `main` and clears a claim file that is not there. This unpacks
`ref` into a scratch directory (`git archive`) and alternates (A B A B ...) the same 2-process `paratrain train`
of gpt-tiny for one step, on the old tree and on this one, timing each launch from the command to its exit (the
start-up: imports, torchrun, the process group, the model, one step, the run directory) in wall seconds and in
the CPU seconds of all its processes (what the start-up costs, whatever else the machine runs). Writes
benchmarks/results/failure_startup.json (raw seconds, medians, the ratio this tree / `ref`). Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "failure_startup.json"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "steps_per_print": 100, "trainer": {"model": "gpt-tiny", "steps": 1, "eval_every": 0, "progress_bar": False}}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launcher and its workers, once waited for
    return usage.ru_utime + usage.ru_stime


def _launch(tree: Path, work: Path, run: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every process of the launch)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cpu, tic = _cpu_of_children(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", str(work / "c.json"),
                           "--run-dir", str(work / run), "--nproc-per-node", "2", "--master-port", _free_port()],
                          cwd=work, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - tic
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: paratrain train failed:\n{done.stderr[-3000:]}")
    return elapsed, _cpu_of_children() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the commit to compare with (the one before the failure reporting)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    git = ["git", "-C", str(ROOT)]
    ref = subprocess.run([*git, "rev-parse", args.ref], check=True, capture_output=True, text=True).stdout.strip()
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="paratrain-startup-") as scratch:
        old, work = Path(scratch) / "old", Path(scratch) / "work"
        archive = subprocess.run([*git, "archive", ref, "paratrain"], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(old, filter="data")
        work.mkdir()
        (work / "c.json").write_text(json.dumps(CONFIG))
        trees = {"old": old, "new": ROOT}
        _launch(ROOT, work, "warm")  # the first launch pays for cold file caches: not counted
        wall: dict[str, list[float]] = {"old": [], "new": []}
        cpu: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.repeats):
            for name, tree in trees.items():
                seconds, used = _launch(tree, work, f"{name}{i}")
                wall[name].append(seconds)
                cpu[name].append(used)
                print(f"{name} {i}: {seconds:.2f} s wall, {used:.2f} s CPU", flush=True)
    result = {"ref": ref, "head": head, "repeats": args.repeats,
              "command": "paratrain train --nproc-per-node 2 (gpt-tiny, 1 step), from the command to its exit, "
                         "A B interleaved",
              "cpus": os.cpu_count(), "load_average_after": os.getloadavg(),
              "note": "the CPU seconds of every process of the launch (launcher and workers) are what start-up "
                      "costs; the wall seconds also hold the waiting on whatever else the machine was running",
              **{f"{kind}_{what}": value for kind, times in (("cpu", cpu), ("wall", wall))
                 for what, value in _stats(times).items()}}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.endswith(("median_s", "ratio_new_over_old"))}, indent=1))


def _stats(times: dict[str, list[float]]) -> dict:
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"raw_s": times, "median_s": medians, "ratio_new_over_old": medians["new"] / medians["old"],
            "spread_s": {name: [min(values), max(values)] for name, values in times.items()}}


if __name__ == "__main__":
    main()

"""Checkpoint stall, synchronous against asynchronous (`checkpoint.async_save`), in the real job on 2 processes:

    python -m benchmarks.checkpoint_async --rounds 2

Two models, each trained by `paratrain train --nproc-per-node 2` on the embedded corpus with a save every few steps:
- "demo": `configs/demo.json` as `make demo` runs it (gpt-mini, 0.8 M parameters, dp2, AdamW), a save every 10 steps;
- "gpt-125m": the gpt-125m preset with the byte tokenizer's vocabulary (256) and 256-token rows (85 M parameters),
  ZeRO-3 over dp2, 2 rows per rank per step, a save every 3 steps.

Each round runs the synchronous job and the asynchronous one back to back (alternating which goes first), on the
same seed and data: their losses must be equal, bit for bit. What is read from the runs' summaries and metrics rows
(the job saves after writing the step's row, so no step time holds a stall):
- stall: each save's `stall_s`, the save call until training goes on (rank 0's; the median over the saves, and the
  first save's, which also plans what every later save reads: `first_stall_s`);
- step: the median step time of the steps that had no write in flight (`plain_step_s`), and of the steps that ran
  while an asynchronous write was in flight (`step_during_write_s`: the writing thread's cost to training, which the
  stall does not show);
- write: `checkpoint/write_s`, the rank files to `latest`.
The target (issue 51): an asynchronous stall at most 5% of a step. Results: benchmarks/results/checkpoint_async.json;
the docs' table is printed at the end. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_async.json"


def _demo(steps: int) -> dict:
    cfg = json.loads((ROOT / "configs" / "demo.json").read_text())
    cfg["trainer"].update(steps=steps, eval_every=0, progress_bar=False)
    return cfg


def _gpt125m(steps: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3}, "steps_per_print": 1000, "seed": 1234,
            "trainer": {"model": "gpt-125m", "model_overrides": {"vocab_size": 256, "seq_len": 256}, "steps": steps,
                        "eval_every": 0, "progress_bar": False}}


MODELS = {"demo": (_demo, 60, 10), "gpt-125m": (_gpt125m, 12, 3)}  # config, steps, save_every


def _run(name: str, async_save: bool, work: Path) -> dict:
    make, steps, every = MODELS[name]
    cfg = make(steps)
    cfg["checkpoint"] = {"dir": str(work / "ck"), "save_every": every, "async": async_save}
    (work / "c.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", str(work / "c.json"),
                           "--nproc-per-node", "2", "--run-dir", str(work / "run")], cwd=work, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((work / "run" / "summary.json").read_text())
    return {"rows": [{k: r[k] for k in ("step", "loss", "step_time_s", "checkpoint/stall_s", "checkpoint/write_s")
                      if k in r} for r in rows],
            "saves": summary["checkpoints"], "wall_s": time.perf_counter() - start}


def _in_flight_steps(run: dict) -> set[int]:
    """The steps that ran while an asynchronous write was in flight: after the step a save followed (the job saves
    after writing the step's row), until the row that reports its write (that row's step included: the write ended
    during it)."""
    steps = set()
    for save in (s for s in run["saves"] if s["async"]):
        for row in (r for r in run["rows"] if r["step"] > save["step"]):
            steps.add(row["step"])
            if "checkpoint/write_s" in row:
                break
    return steps


def _measures(run: dict) -> dict:
    during = _in_flight_steps(run)
    plain = [r["step_time_s"] for r in run["rows"][1:] if r["step"] not in during]  # step 1: warm-up
    stalls = [s["stall_s"] for s in run["saves"]]  # every save's, the one after the last step included
    stall = statistics.median(stalls)
    writes = [s["write_s"] for s in run["saves"]]
    in_flight = [r["step_time_s"] for r in run["rows"] if r["step"] in during]
    step = statistics.median(plain)
    # the first save also works out what the engine's saves take from the model (save.py's SavePlan), once
    return {"stall_s": stall, "first_stall_s": stalls[0], "plain_step_s": step, "stall_per_step": stall / step,
            "write_s": statistics.median(writes),
            "step_during_write_s": statistics.median(in_flight) if in_flight else None,
            "staged_mib": max((s.get("staged_bytes", 0) for s in run["saves"]), default=0) / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    out = {"suite": "checkpoint_async", "machine": os.uname().machine, "cpus": os.cpu_count(), "rounds": {}}
    for name in args.models:
        rounds = []
        for i in range(args.rounds):
            pair = {}
            for async_save in ((False, True) if i % 2 == 0 else (True, False)):
                with tempfile.TemporaryDirectory() as tmp:
                    run = _run(name, async_save, Path(tmp))
                pair["async" if async_save else "sync"] = {**_measures(run), "raw": run}
                print(name, i, "async" if async_save else "sync",
                      {k: v for k, v in pair["async" if async_save else "sync"].items() if k != "raw"}, flush=True)
            losses = {mode: [r["loss"] for r in pair[mode]["raw"]["rows"]] for mode in pair}
            pair["losses_equal"] = losses["sync"] == losses["async"]
            rounds.append(pair)
        out["rounds"][name] = rounds
    out["summary"] = {name: {mode: {k: statistics.median(r[mode][k] for r in rounds)
                                    for k in ("stall_s", "plain_step_s", "stall_per_step", "write_s")}
                             for mode in ("sync", "async")} for name, rounds in out["rounds"].items()}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    lines = ["| model | checkpoint | stall (ms) | plain step (ms) | stall / step | write (ms) | step with a write in "
             "flight (ms) |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, rounds in out["rounds"].items():
        for mode in ("sync", "async"):
            m = out["summary"][name][mode]
            during = [r[mode]["step_during_write_s"] for r in rounds if r[mode]["step_during_write_s"] is not None]
            shown = f"{statistics.median(during) * 1e3:.1f}" if during else "-"
            lines.append(f"| {name} | {mode} | {m['stall_s'] * 1e3:.1f} | {m['plain_step_s'] * 1e3:.1f} | "
                         f"{m['stall_per_step']:.1%} | {m['write_s'] * 1e3:.1f} | {shown} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

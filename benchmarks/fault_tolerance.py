"""Replica groups on torchft against plain HSDP, and what a failure costs, in the real job on this machine:

    python -m benchmarks.fault_tolerance --rounds 3

The model is gpt-small with the byte vocabulary: 6 layers, width 256, 128-token rows, about 4.9 M parameters. Every
rank takes 2 rows per micro-batch with 2 micro-batches per step. Two jobs run with the same global batch and the
same rows:
- **HSDP:** `paratrain train --nproc-per-node 4` with ZeRO-3 sharded over 2 ranks and `data_parallel.replicate: 2`;
- **replica groups:** `paratrain train --replica-groups 2 --nproc-per-node 2`, ZeRO-3 inside each group, the
  groups' sums through torchft.

Both are timed by their median step, from step 3 on, alternating over the rounds; their losses must agree within
1e-5.

Then the replica-groups job runs again with a rank of group 1 SIGKILLed in the middle of step 5
(`fault_tolerance.inject_failure`), and its summaries give:
- the survivors' extra time in the failed step (failed attempts + redo, less a step without a failure) against the
  heartbeat timeout plus one step;
- the restarted group's time from its processes' start to its rejoining.

With `--peer`, the recovery is measured beside torchft's own loop (`benchmarks/torchft_loop.py`: torchft's DDP and
optimizer wrapper at their defaults, under torch's launcher), both with 2 groups of one process (the paratrain job's
micro-batches then 4 rows, 1 per step, the same rows per step), and added to the results file as `torchft_peer`.
torchft's published figures could not be read from this machine; this is the side-by-side that can be run here.

Results: benchmarks/results/fault_tolerance.json; the docs' table is printed at the end. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fault_tolerance.json"
STEPS, RECOVERY_STEPS, KILL_AT = 25, 40, 5
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "seed": 3, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
        "trainer": {"model": "gpt-small", "model_overrides": {"dropout": 0.0}, "eval_every": 0,
                    "progress_bar": False}}
FT = {"enabled": True, "heartbeat_timeout_s": 2.0, "timeout_s": 30.0}


def _run(config: dict, launch: list[str], steps: int, work: Path) -> dict:
    cfg = {**config, "trainer": {**config["trainer"], "steps": steps}}
    (work / "c.json").write_text(json.dumps(cfg))
    done = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", "c.json", "--run-dir", "out",
                           *launch], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(line) for line in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    summaries = {p.parent.name: json.loads(p.read_text()) for p in (work / "out").rglob("summary.json")}
    kept = ("step", "loss", "step_time_s", "participants", "early_sums")
    return {"rows": [{k: r.get(k) for k in kept} for r in rows],
            "summaries": summaries}


def _steady(run: dict) -> float:
    return statistics.median(r["step_time_s"] for r in run["rows"][2:])


def _pair(work: Path) -> dict:
    out = {}
    for name, cfg, launch in (("hsdp", {**BASE, "data_parallel": {"replicate": 2}}, ["--nproc-per-node", "4"]),
                              ("replica groups", {**BASE, "fault_tolerance": FT},
                               ["--replica-groups", "2", "--nproc-per-node", "2"])):
        (work / name).mkdir()
        out[name] = _run(cfg, launch, STEPS, work / name)
        out[name]["median_step_s"] = _steady(out[name])
    losses = [(a["loss"], b["loss"]) for a, b in zip(out["hsdp"]["rows"], out["replica groups"]["rows"])]
    out["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in losses)
    out["ratio"] = out["replica groups"]["median_step_s"] / out["hsdp"]["median_step_s"]
    return out


def _recovery(work: Path, nproc: int = 2) -> dict:
    cfg = {**BASE, "fault_tolerance": {**FT, "inject_failure": {"replica_group": 1, "at_step": KILL_AT}}}
    if nproc == 1:  # the layout of the torchft peer: one rank per group, its 2 micro-batches of 2 rows in one
        cfg = {**cfg, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
               "fault_tolerance": {**FT, "inject_failure": {"replica_group": 1, "at_step": KILL_AT, "rank": 0}}}
    run = _run(cfg, ["--replica-groups", "2", "--nproc-per-node", str(nproc)], RECOVERY_STEPS, work)
    (record,) = run["summaries"]["out"]["recoveries"]
    healed = run["summaries"]["replica1"]["healed"]
    plain = statistics.median(r["step_time_s"] for r in run["rows"][2:] if r["participants"] == 2)
    return {"recovery": {k: v for k, v in record.items() if k != "failed_at"}, "healed": healed,
            "median_step_s": plain, "heartbeat_timeout_s": FT["heartbeat_timeout_s"],
            "failed_step_extra_s": record["failed_step_s"] - plain,
            "failed_step_bound_s": FT["heartbeat_timeout_s"] + plain, "rows": run["rows"]}


def _torchft_peer(work: Path) -> dict:
    """torchft's own loop (`benchmarks/torchft_loop.py`), 2 groups of one process under torch's launcher, group 1
    killed after the backward of step KILL_AT: the same measures from its rows."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=int(FT["heartbeat_timeout_s"] * 1000))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                               "--max-restarts", "3", "--master-port", str(29620 + g),
                               str(ROOT / "benchmarks" / "torchft_loop.py"), "--group", str(g), "--steps",
                               str(RECOVERY_STEPS), "--kill-group", "1", "--kill-step", str(KILL_AT), "--out",
                               str(work)], env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for g in range(2)]
    errors = [p.communicate()[1] for p in procs]
    lighthouse.shutdown()
    if any(p.returncode for p in procs):
        raise SystemExit("\n".join(e[-3000:] for e in errors))
    survivor, restarted = ([json.loads(x) for x in (work / f"group{g}.jsonl").read_text().splitlines()]
                           for g in range(2))
    plain = statistics.median(r["s"] for r in survivor[2:] if r["committed"] and r["participants"] == 2)
    # from the attempt of the step group 1 died in to the first step the survivor committed in the new quorum (torchft
    # commits the failed step itself when its all-reduce ended before the kill; the next quorum waits out the
    # heartbeat), less a plain step for each step committed meanwhile: the same measure as paratrain's failed step
    start = next(i for i, r in enumerate(survivor) if r["step"] >= KILL_AT)
    back = next(i for i in range(start, len(survivor))
                if survivor[i]["committed"] and survivor[i]["participants"] == 1)
    span = survivor[start:back + 1]
    extra = sum(r["s"] for r in span) - plain * sum(r["committed"] for r in span)
    healed = next(r for r in restarted if r["restart"] and "healed_s" in r)
    after = survivor[start:]
    alone = [r for r in after if r["committed"] and r["participants"] == 1]
    return {"median_step_s": plain, "failed_span_s": [r["s"] for r in span], "failed_step_extra_s": extra,
            "failed_step_bound_s": FT["heartbeat_timeout_s"] + plain, "process_start_to_rejoin_s": healed["healed_s"],
            "steps_alone": len(alone),
            # rows of the global batch no group trained: the attempts that did not commit, and group 1's share of
            # each step the survivor took alone (4 rows per group and step)
            "rows_not_trained": (sum(not r["committed"] for r in after) + len(alone)) * 4,
            "rows": {"survivor": survivor, "restarted": restarted}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer", action="store_true",
                        help="only the torchft peer's recovery beside paratrain's at one rank per group, added to the "
                             "results file")
    args = parser.parse_args(argv)
    if args.peer:
        out = json.loads(RESULTS.read_text())
        rounds = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
                rounds.append({"torchft": _torchft_peer(Path(a)), "paratrain": _recovery(Path(b), nproc=1)})
            print(peer_table([rounds[-1]]), flush=True)
        out["torchft_peer"] = rounds
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
        print(peer_table(rounds))
        return 0
    out = {"suite": "fault_tolerance", "machine": os.uname().machine, "cpus": os.cpu_count(), "rounds": []}
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            pair = _pair(Path(tmp))
        out["rounds"].append(pair)
        print(f"round {i}: ratio {pair['ratio']:.3f} (hsdp {pair['hsdp']['median_step_s'] * 1e3:.1f} ms, replica "
              f"groups {pair['replica groups']['median_step_s'] * 1e3:.1f} ms), losses within "
              f"{pair['max_loss_rel_diff']:.1e}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out["failure"] = _recovery(Path(tmp))
    out["summary"] = {"ratio": statistics.median(r["ratio"] for r in out["rounds"]),
                      "ratios": [r["ratio"] for r in out["rounds"]]}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    hsdp = statistics.median(r["hsdp"]["median_step_s"] for r in out["rounds"])
    groups = statistics.median(r["replica groups"]["median_step_s"] for r in out["rounds"])
    f = out["failure"]
    rec, healed = f["recovery"], f["healed"]
    return "\n".join([
        "| measure | result | target |", "|---|---:|---|",
        f"| steady step, replica groups / HSDP | {out['summary']['ratio']:.3f} ({groups * 1e3:.1f} vs {hsdp * 1e3:.1f}"
        f" ms; rounds {', '.join(f'{r:.3f}' for r in out['summary']['ratios'])}) | ≤ 1.05 |",
        f"| survivors' extra time in the failed step | {f['failed_step_extra_s']:.2f} s (the step took "
        f"{rec['failed_step_s']:.2f} s: failed attempt {sum(rec['failed_attempts_s']):.2f} s + redo {rec['redo_s']:.2f}"
        f" s, against {f['median_step_s']:.2f} s for a step without a failure) | ≤ heartbeat "
        f"{f['heartbeat_timeout_s']} s + one step {f['median_step_s']:.2f} s = {f['failed_step_bound_s']:.2f} s |",
        f"| restarted group: process start to rejoining | {healed['process_start_to_rejoin_s']:.2f} s (healed at "
        f"step {healed['healed_at_step']}) | ≤ 10 s |",
        f"| steps trained by the survivors alone | {rec['rejoined_at_step'] - rec['step']} (rejoined at step "
        f"{rec['rejoined_at_step']}, {rec['degraded_s']:.2f} s after the failure) | — |",
        f"| rows lost | {rec['lost_rows']} | 0 |"])


def peer_table(rounds: list[dict]) -> str:
    """Medians over the rounds (each value's rounds in brackets when there are several)."""
    def cell(side: str, read, unit: str = " s") -> str:
        values = [read(r[side]) for r in rounds]
        shown = f"{statistics.median(values):.2f}{unit}" if unit else f"{statistics.median(values)}"
        return shown + (f" ({', '.join(f'{v:.2f}' if unit else str(v) for v in values)})" if len(values) > 1 else "")

    rows = [("step without a failure", lambda r: r["median_step_s"], " s"),
            ("survivors' extra time in the failed step", lambda r: r["failed_step_extra_s"], " s"),
            ("the bound: heartbeat + one step", lambda r: r["failed_step_bound_s"], " s"),
            ("restarted group: process start to rejoining",
             lambda r: r.get("process_start_to_rejoin_s", r.get("healed", {}).get("process_start_to_rejoin_s")), " s"),
            ("rows of the global batch never trained",
             lambda r: r.get("rows_not_trained", r.get("recovery", {}).get("lost_rows")), "")]
    lines = ["| 2 groups × 1 process, group 1 killed at step 5 | torchft's own loop | paratrain |", "|---|---:|---:|"]
    lines += [f"| {name} | {cell('torchft', read, unit)} | {cell('paratrain', read, unit)} |"
              for name, read, unit in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

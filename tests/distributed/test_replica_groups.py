"""Replica groups on torchft, end to end through `paratrain train --replica-groups 2 --nproc-per-node 2`: a rank of
group 1 SIGKILLed in the middle of step 5 (`fault_tolerance.inject_failure`), the survivors redo that step with the
failed group's rows, the restarted group heals from a live peer and rejoins, and the job ends with every step's loss
and the final weights equal (1e-5) to the same job without the failure. ZeRO-3 inside each group (and the plain
HSDP job on 4 ranks it equals), and tp2 inside each group. Nothing here asserts a time: the recovery times are
recorded in the summaries and benchmarked in benchmarks/fault_tolerance.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.checkpoint.export import CheckpointReader
from paratrain.testing.compare import max_rel_diff

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_AT = 24, 5
# every step sleeps this long after committing, so the killed group's restart (3-4 s here) fits well inside the run
PAUSE_S = "0.3"
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "seed": 3, "steps_per_print": 100,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.1}}, "gradient_clipping": 1.0,
        "checkpoint": {"dir": "ck"},
        "trainer": {"model": "gpt-tiny", "model_overrides": {"dropout": 0.0, "bias": False}, "steps": STEPS,
                    "eval_every": 0,
                    "progress_bar": False}}
FT = {"enabled": True, "heartbeat_timeout_s": 2.0, "timeout_s": 20.0}
# ZeRO-3 with every parameter in a unit (none kept whole: this tiny model's would all be under the default threshold)
LAYOUTS = {"zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
           "tp2": {"zero_optimization": {"stage": 1}, "tensor_parallel": {"size": 2}}}


def _train(cwd: Path, config: dict, *launch: str) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "c.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", "c.json", "--run-dir", "out",
                          *launch], cwd=cwd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                              "PARATRAIN_TEST_STEP_PAUSE_S": PAUSE_S})
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    return run.stdout + run.stderr


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _weights_error(got: Path, want: Path) -> float:
    """The parity tests' measure (`paratrain.testing.compare`): the worst tensor's ||got - want|| / ||want||."""
    return max_rel_diff(CheckpointReader(got).model_state(), CheckpointReader(want).model_state())[0]


def _groups(tmp_path: Path, layout: str, failure: bool) -> Path:
    cfg = {**BASE, **LAYOUTS[layout], "fault_tolerance": {
        **FT, **({"inject_failure": {"replica_group": 1, "at_step": KILL_AT}} if failure else {})}}
    cwd = tmp_path / f"{layout}_{'killed' if failure else 'whole'}"
    _train(cwd, cfg, "--replica-groups", "2", "--nproc-per-node", "2")
    return cwd


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_group_killed_mid_step_heals_and_the_run_equals_the_uninterrupted_one(tmp_path, layout):
    whole, killed = _groups(tmp_path, layout, False), _groups(tmp_path, layout, True)
    want, got = _rows(whole / "out"), _rows(killed / "out")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)) == [r["step"] for r in want]
    assert all(r["participants"] == 2 and r["shards"] == [0] for r in want)  # both groups, one shard each
    # ZeRO-3: the groups' sums of the shards start during the backward (all but the last units'); ZeRO-1: after it
    early = [r["early_sums"] for r in want + got]
    assert all(e > 0 for e in early) if layout == "zero3" else not any(early), early
    errors = [_relative(g["loss"], w["loss"]) for g, w in zip(got, want)]
    assert max(errors) <= 1e-5, errors
    norms = [_relative(g["grad_norm"], w["grad_norm"]) for g, w in zip(got, want)]
    assert max(norms) <= 1e-5, norms
    assert _weights_error(killed / "ck", whole / "ck") <= 1e-5
    # step 5 failed and was redone on both shards: by group 0 alone, or by both groups when group 1 was back in time
    (recovery,) = json.loads((killed / "out" / "summary.json").read_text())["recoveries"]
    print(layout, {k: v for k, v in recovery.items() if k != "failed_at"})
    assert recovery["step"] == KILL_AT and recovery["shards_trained"] == 2 and recovery["lost_rows"] == 0
    assert recovery["participants_before"] == 2 and len(recovery["failed_attempts_s"]) >= 1
    if recovery["participants_after"] == 1:  # alone, the redo trained group 1's shard; group 0's own was kept
        assert recovery["redo_shards_trained_here"] == 1, recovery
    rejoined = recovery["rejoined_at_step"]
    assert KILL_AT <= rejoined <= STEPS and recovery["degraded_s"] > 0
    alone = [r for r in got if KILL_AT <= r["step"] < rejoined]
    assert all(r["participants"] == 1 and r["shards"] == [0, 1] for r in alone), alone
    assert all(r["participants"] == 2 and r["shards"] == [0] for r in got if r["step"] >= rejoined)
    # `paratrain report` tells the failure and its recovery from the run's files
    report = subprocess.run([sys.executable, "-m", "paratrain.cli", "report", "out"], cwd=killed, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert report.returncode == 0, report.stderr[-3000:]
    assert f"step {KILL_AT} failed" in report.stdout and "2 of 2 shards" in report.stdout, report.stdout
    assert "0 rows lost" in report.stdout and f"every group back at step {rejoined}" in report.stdout, report.stdout
    restarted = json.loads((killed / "out" / "replica1" / "summary.json").read_text())
    assert restarted["restart"] == 1 and restarted["steps"] == STEPS
    assert restarted["healed"]["healed_at_step"] == recovery["rejoined_at_step"] - 1, restarted["healed"]
    # the restarted group's rows (after healing) are group 0's, step by step
    theirs = {r["step"]: r["loss"] for r in _rows(killed / "out" / "replica1")}
    assert all(_relative(theirs[r["step"]], r["loss"]) <= 1e-5 for r in got if r["step"] in theirs)
    if layout == "zero3":  # and the groups' run is the plain HSDP job on 4 ranks (ZeRO-3 over 2, replicated over 2)
        plain = tmp_path / "plain"
        _train(plain, {**BASE, **LAYOUTS[layout], "data_parallel": {"replicate": 2}}, "--nproc-per-node", "4")
        hsdp = _rows(plain / "out")
        assert max(_relative(w["loss"], p["loss"]) for w, p in zip(want, hsdp)) <= 1e-5
        assert _weights_error(whole / "ck", plain / "ck") <= 1e-5


def test_bad_fault_tolerance_input_is_named(tmp_path):
    from paratrain.config import ConfigError, load_config
    from paratrain.errors import InvalidValueError

    def config(**ft):
        return {**BASE, "zero_optimization": {"stage": 3}, "fault_tolerance": {"enabled": True, **ft}}

    with pytest.raises((ConfigError, InvalidValueError), match="zero_optimization.stage is 0"):
        load_config({**config(), "zero_optimization": {"stage": 0}})
    with pytest.raises((ConfigError, InvalidValueError), match="fault_tolerance.min_replicas = 3 is more than the 2"):
        load_config(config(min_replicas=3, replica_groups=2))
    with pytest.raises((ConfigError, InvalidValueError), match="inject_failure.replica_group = 2, but the groups"):
        load_config(config(inject_failure={"replica_group": 2, "at_step": 1}))
    # a failure injected into a rank the groups do not have: refused once by the launcher, before any group starts
    cwd = tmp_path / "rank"
    cwd.mkdir()
    (cwd / "c.json").write_text(json.dumps(config(inject_failure={"replica_group": 1, "at_step": 2, "rank": 1})))
    run = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", "c.json", "--run-dir", "out",
                          "--replica-groups", "2", "--nproc-per-node", "1"], cwd=cwd, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and not (cwd / "out").exists(), run.stderr[-3000:]
    assert run.stderr.count("fault_tolerance.inject_failure.rank = 1, but --nproc-per-node gives each group 1") == 1
    # an unreachable Lighthouse: the job stops after fault_tolerance.timeout_s, naming the field
    cwd = tmp_path / "nowhere"
    cwd.mkdir()
    (cwd / "c.json").write_text(json.dumps(config(lighthouse="http://127.0.0.1:9", timeout_s=2.0)))
    run = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--config", "c.json", "--run-dir", "out"],
                         cwd=cwd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0
    assert "fault_tolerance.lighthouse 'http://127.0.0.1:9' did not answer" in run.stderr, run.stderr[-3000:]

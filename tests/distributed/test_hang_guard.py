"""The hang guard: a rank that skips a collective makes the others stop with a report naming it, within
the configured timeout; the test harness survives ranks stuck inside C++ waits; a launched job ends."""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.comm import CollectiveTimeout, CommGuard, all_reduce
from paratrain.layout.mesh import Axis
from paratrain.testing import World, WorldError
from tests.cases import adamw_config, corpus_windows, tiny_gpt

GUARD_TIMEOUT_S = 2.0


# ---- the guard's bookkeeping, in one process -----------------------------------------------------------
class _FakeWork:
    def __init__(self, done: bool):
        self.done = done

    def wait(self, timeout=None):
        if not self.done:
            raise RuntimeError("Operation timed out!")  # what torch's Work.wait(timeout) raises
        return True

    def is_completed(self) -> bool:
        return self.done


def test_guard_numbers_calls_forgets_finished_ones_and_reports_the_stuck_one(tmp_path, capsys):
    from paratrain.comm import Handle

    guard = CommGuard(rank=5, timeout_s=0.5, report_dir=tmp_path)
    x = torch.zeros(4, 2)
    first = Handle(_FakeWork(True), guard=guard, key=guard.begin("dp", "all_reduce", "grad", [x], (4, 5)))
    first.wait()
    polled = Handle(_FakeWork(True), guard=guard, key=guard.begin("tp", "all_gather", "tp", [x], (5,)))
    assert polled.is_completed()
    dropped = Handle(_FakeWork(False), guard=guard, key=guard.begin("cp", "send", "cp", [x], (4,)))
    del dropped  # nobody will wait for it any more
    assert guard._in_flight == {}
    stuck = Handle(_FakeWork(False), guard=guard, key=guard.begin("dp", "all_reduce", "grad", [x], (4, 5)))
    with pytest.raises(CollectiveTimeout, match=r"rank 5 stopped: waited 0.\d s \(comm.timeout_s = 0.5\) in "
                       r"all_reduce #2 on axis 'dp' \(ranks 4, 5\) \[grad\] shapes \[\(4, 2\)\] float32"):
        stuck.wait()
    written = json.loads((tmp_path / "hang_report_rank5.json").read_text())
    assert written["waiting_in"]["call"] == 2 and written["calls_made"] == {
        "cp/send": 1, "dp/all_reduce": 2, "tp/all_gather": 1}
    assert "all_reduce #2 on axis 'dp'" in capsys.readouterr().err


def _wait_for_skipped(run) -> dict:
    """Run `run()` on every rank but the last, which skips it; return what the guard reported."""
    if dist.get_rank() == dist.get_world_size() - 1:
        return {"skipped": True}
    stderr = io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stderr(stderr):
            run()
    except CollectiveTimeout as exc:
        return {"elapsed": time.monotonic() - start, "report": exc.report, "message": str(exc),
                "stderr": stderr.getvalue()}
    return {"completed": True}


def _skip_cases(report_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    # 1. gloo's own timeout fires first (a group with a 1 s backend timeout, the guard's at 60 s).
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    guard = CommGuard(rank, timeout_s=60.0, report_dir=f"{report_dir}/backend")
    axis = Axis("dp", tuple(range(world)), rank, group, None, guard)
    backend_first = _wait_for_skipped(lambda: all_reduce(torch.ones(3), axis, tag="probe"))
    # 2. The engine: the last rank skips a training step, the others wait in the gradient all-reduce.
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, comm={"timeout_s": GUARD_TIMEOUT_S,
                                                              "report_dir": f"{report_dir}/engine"})
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
    engine.train_batch()  # a whole step on every rank
    params = sum(p.numel() for p in engine.module.parameters())
    return {"backend_first": backend_first, "engine": _wait_for_skipped(engine.train_batch), "params": params,
            "configured": engine.mesh.guard.timeout_s}


def test_a_skipped_collective_is_reported_by_every_waiting_rank(world4, tmp_path):
    try:
        results = world4.run(_skip_cases, str(tmp_path))
    finally:
        world4.restart()  # three ranks still hold the collectives that never completed
    assert results[3]["backend_first"] == {"skipped": True} and results[3]["engine"] == {"skipped": True}
    assert not (tmp_path / "engine" / "hang_report_rank3.json").exists()
    for rank, r in enumerate(results[:3]):
        assert r["configured"] == GUARD_TIMEOUT_S  # the config's comm.timeout_s reached the comm layer
        # The engine's second step: the ranks wait in the fourth all-reduce on dp (1: the token loss's backprop
        # unit, once per engine; 2: step 1's gradients, 3: step 1's loss sum and target count, 4: step 2's
        # gradients), one bucket of every parameter.
        engine = r["engine"]
        report = engine["report"]
        assert report["waiting_in"] | {"seconds_in_flight": 0} == {
            "axis": "dp", "op": "all_reduce", "call": 4, "tag": "grad", "shapes": [(r["params"],)],
            "dtypes": ["float32"], "ranks": (0, 1, 2, 3), "timed": True, "seconds_in_flight": 0}
        assert report["rank"] == rank and report["reason"].startswith("waited 2.0 s (comm.timeout_s = 2)")
        assert GUARD_TIMEOUT_S <= report["waiting_in"]["seconds_in_flight"] < GUARD_TIMEOUT_S + 1.0
        assert engine["elapsed"] < GUARD_TIMEOUT_S + 5.0  # the step (forward, backward) and the wait
        assert report["calls_made"] == {"dp/all_reduce": 4, "dp/broadcast": 1}
        assert "all_reduce #4 on axis 'dp' (ranks 0, 1, 2, 3) [grad]" in engine["message"]
        assert engine["message"] in engine["stderr"]  # printed, with the report, on the rank's stderr
        written = json.loads((tmp_path / "engine" / f"hang_report_rank{rank}.json").read_text())
        assert written["waiting_in"]["call"] == 4 and written["reason"] == report["reason"]
        # gloo's timeout first: still a report naming the collective, with the backend's reason.
        first = r["backend_first"]["report"]
        assert first["waiting_in"]["op"] == "all_reduce" and first["waiting_in"]["call"] == 1
        assert first["waiting_in"]["tag"] == "probe" and first["waiting_in"]["shapes"] == [(3,)]
        assert first["reason"].startswith("the backend failed after") and r["backend_first"]["elapsed"] < 10
        assert (tmp_path / "backend" / f"hang_report_rank{rank}.json").exists()
    world4.run(dist.barrier)  # the restarted world works


# ---- the harness: a rank blocked inside a C++ wait is killed, the world restarts -------------------------
def _block_in_cpp() -> None:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=600))
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1, group=group)  # rank 1 never sends: blocked in gloo


def _fail_while_peer_waits() -> None:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=600))
    if dist.get_rank() == 0:
        raise ValueError("rank 0 gives up")
    dist.recv(torch.zeros(1), src=0, group=group)


@pytest.mark.multiprocess
def test_world_kills_ranks_stuck_in_a_collective_and_restarts():
    with World(2, timeout_s=2.0, grace_s=2.0, after_failure_s=2.0) as world:
        start = time.monotonic()
        with pytest.raises(WorldError, match="rank 0: no answer within 4s"):
            world.run(_block_in_cpp)
        assert time.monotonic() - start < 20
        assert world.run(dist.get_world_size) == [2, 2]  # a fresh world
        world.timeout_s = 600.0  # only the other rank's failure can end the next sub-case early
        start = time.monotonic()
        with pytest.raises(WorldError, match="(?s)rank 0 gives up.*rank 1: no answer after another rank failed"):
            world.run(_fail_while_peer_waits)
        assert time.monotonic() - start < 20
        assert world.run(dist.get_world_size) == [2, 2]


# ---- a launched job stops instead of hanging at exit ------------------------------------------------------
@pytest.mark.multiprocess
def test_launched_job_stops_with_reports(tmp_path):
    from tests.distributed.test_cli import _free_port, _paratrain

    script = tmp_path / "skip.py"
    script.write_text(textwrap.dedent("""
        import time, torch, torch.distributed as dist
        import paratrain
        from paratrain.comm import all_reduce
        paratrain.init_distributed(timeout=120)  # gloo alone would wait two minutes
        mesh = paratrain.build_mesh(paratrain.ParallelDims(dist.get_world_size()))
        mesh.guard.configure(timeout_s=2, report_dir="reports")
        if dist.get_rank() == 1:
            time.sleep(60)  # alive, but never joins
        else:
            all_reduce(torch.ones(4), mesh.axis("dp"), tag="probe")
    """))
    start = time.monotonic()
    run = _paratrain("run", "--nproc-per-node", "2", "--master-port", _free_port(), str(script), cwd=tmp_path,
                     timeout=100)
    assert run.returncode != 0
    assert time.monotonic() - start < 45, "the job waited for the sleeping rank"
    assert "rank 0 stopped: waited 2.0 s (comm.timeout_s = 2) in all_reduce #1 on axis 'dp'" in run.stderr
    report = json.loads(Path(tmp_path / "reports" / "hang_report_rank0.json").read_text())
    assert report["waiting_in"]["tag"] == "probe" and not (tmp_path / "reports" / "hang_report_rank1.json").exists()

"""Pipeline parallelism against the single-process reference: every schedule at p = 2 and 4 and dp2 x pp2,
its point-to-point traffic counted, evaluation, the timeline and `paratrain report`."""

from __future__ import annotations

import json

import pytest
import torch

import paratrain
from paratrain.cli import main as cli_main
from paratrain.data import default_collate
from paratrain.parallel.pp.schedules import build_schedule, stages_of_rank
from paratrain.parallel.pp.timeline import measured_bubbles
from paratrain.parallel.pp.validate import simulate
from paratrain.testing import max_rel_diff, rel_diff
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt
from tests.distributed.test_cli import ROOT, _free_port, _paratrain

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 5
N_LAYER = 6  # 8 pipeline layers (embed, 6 blocks, head): enough for p = 4 with 2 chunks per rank
MICRO_BATCH = 2
BSH = MICRO_BATCH * 16 * 32  # elements of one activation message: micro-batch x seq_len x d_model
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]


def _micro_batches(schedule: str, stages: int) -> int:
    return 2 * stages if schedule == "dualpipev" else 4  # DualPipeV fills its V with 2p micro-batches


def _model():
    return tiny_gpt(n_layer=N_LAYER)


def _case(schedule: str, stages: int, m: int, virtual: int) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=m,
                       pipeline={"stages": stages, "schedule": schedule, "virtual_stages": virtual,
                                 "partition": "uniform"})
    data = corpus_windows()
    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = paratrain.initialize(model=model, config=cfg, training_data=data)
    losses, norms = [], []
    for i in range(STEPS):
        engine.comm_stats(reset=True)
        losses.append(float(engine.train_batch()))
        norms.append(engine.get_global_grad_norm())
        if i == 1:  # a step after the first: the shape headers have been exchanged already
            stats = engine.comm_stats(by_tag=True)
    ref = reference_run(_model, {**cfg, "train_batch_size": engine.train_batch_size()}, data, STEPS)
    param_err, where = max_rel_diff(engine.full_state_dict(), ref.state)
    batches = [default_collate([data[i] for i in range(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)]) for k in range(m)]
    eval_loss = float(engine.eval_batch(iter(batches)))
    reference = _model()
    reference.load_state_dict(ref.state)
    with torch.no_grad():
        ref_eval = sum(float(reference(x, y)) for x, y in batches) / m
    try:
        engine(*batches[0])
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    timeline = engine.pipeline_timeline()
    return {"case": (schedule, stages, m, virtual), "loss_err": max(rel_diff(a, b) for a, b in zip(losses, ref.losses)),
            "norm_err": max(rel_diff(a, b) for a, b in zip(norms, ref.grad_norms)), "param_err": param_err,
            "where": where, "losses": losses, "eval_err": rel_diff(eval_loss, ref_eval), "psi": psi,
            "pp": stats.get("pp", {}), "dp": stats.get("dp", {}), "params": engine.memory_stats()["params"],
            "coords": engine.mesh.coords, "refused": refused,
            "timeline": timeline if engine.global_rank == 0 else None}


class _Split(torch.nn.Module):
    """x -> (h, gate, index): two float tensors with gradients and an integer one between the stages."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.a(x), torch.sigmoid(self.b(x)), (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class _Mix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(16, 16)

    def forward(self, inputs):
        h, gate, index = inputs
        return torch.tanh(self.w(h)) * gate + index.unsqueeze(1).float(), gate, index


def _tuple_model():
    torch.manual_seed(3)
    layers = [_Split(), _Mix(), _Mix(), lambda t: t[0] * t[1], torch.nn.Linear(16, 2)]
    return paratrain.PipelineModule(layers, loss_fn=torch.nn.functional.mse_loss, partition=[0, 2, 5])


def _tuple_case(schedule: str) -> dict:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, generator=g), torch.randn(2, generator=g)) for _ in range(64)]
    cfg = adamw_config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4,
                       pipeline={"stages": 2, "schedule": schedule})
    engine, *_ = paratrain.initialize(model=_tuple_model(), config=cfg, training_data=data)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch()))
        norms.append(engine.get_global_grad_norm())
    ref = reference_run(lambda: _tuple_model().materialize(), {**cfg, "train_batch_size": 16}, data, STEPS)
    return {"loss_err": max(rel_diff(a, b) for a, b in zip(losses, ref.losses)),
            "norm_err": max(rel_diff(a, b) for a, b in zip(norms, ref.grad_norms)),
            "param_err": max_rel_diff(engine.full_state_dict(), ref.state)[0]}


def _cases(cases: list[tuple]) -> list[dict]:
    return [_case(*c) for c in cases]


@pytest.fixture(scope="module")
def p2(world2):
    return world2.run(_cases, [(s, 2, _micro_batches(s, 2), v) for s, v in SCHEDULES])


@pytest.fixture(scope="module")
def p4_and_dp2pp2(world4):
    return world4.run(_cases, [(s, 4, _micro_batches(s, 4), v) for s, v in SCHEDULES] +
                      [(s, 2, _micro_batches(s, 2), v) for s, v in SCHEDULES])


def _by_case(per_rank: list[list[dict]]) -> list[list[dict]]:
    """[rank][case] -> [case][rank]."""
    return [list(ranks) for ranks in zip(*per_rank)]


def _check_parity(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["eval_err"] <= 1e-5, r
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def _check_traffic(ranks: list[dict]) -> None:
    """Per step, each stage boundary carries m activations forward and m gradients back, b·s·h each."""
    name, p, m, v = ranks[0]["case"]
    schedule = build_schedule(name, p, m, v)
    stages = p * v
    remote = [s for s in range(stages - 1) if not schedule.local(s, s + 1)]  # the bottom of a V is not sent
    for r in ranks:
        mine = stages_of_rank(schedule.placement, r["coords"]["pp"], p, v)
        expected = m * BSH * (sum(s in remote for s in mine) + sum(s - 1 in remote for s in mine))
        assert r["pp"]["send"] == {"pp": {"calls": expected // BSH, "elements": expected, "bytes": 4 * expected}}, r
        assert r["pp"]["recv"]["pp"]["elements"] == expected
    replica = [r for r in ranks if r["coords"]["dp"] == 0]
    assert sum(r["pp"]["send"]["pp"]["elements"] for r in replica) == 2 * m * BSH * len(remote)
    assert sum(r["params"] for r in replica) == 4 * ranks[0]["psi"]  # every parameter on exactly one stage


def test_every_schedule_matches_the_reference_on_2_stages(p2):
    for ranks in _by_case(p2):
        _check_parity(ranks)
        _check_traffic(ranks)
        assert "call engine.train_batch(data_iter)" in ranks[0]["refused"]


def test_every_schedule_matches_the_reference_on_4_stages_and_dp2_x_pp2(p4_and_dp2pp2):
    for ranks in _by_case(p4_and_dp2pp2):
        _check_parity(ranks)
        _check_traffic(ranks)
        if ranks[0]["case"][1] == 2:  # dp2 x pp2: DDP reduced each stage's gradients once per step
            for r in ranks:
                assert r["dp"]["all_reduce"]["grad"] == {"calls": 1, "elements": r["params"] // 4,
                                                          "bytes": r["params"]}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tuples_of_tensors_cross_stage_boundaries(world2, schedule):
    for r in world2.run(_tuple_case, schedule):
        assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r


def test_timeline_and_report(p2, tmp_path):
    timelines = {ranks[0]["case"][0]: ranks[0]["timeline"] for ranks in _by_case(p2)}
    for name, timeline in timelines.items():
        assert [r["pp"] for r in timeline["ranks"]] == [0, 1]
        kinds = {e[0] for r in timeline["ranks"] for e in r["events"]}
        split = name in ("zb-h1", "zb-v", "dualpipev")
        assert kinds == ({"F", "B", "W"} if split else {"F", "B"})
        v = dict(SCHEDULES)[name]
        assert all(len(r["events"]) == (3 if split else 2) * 4 * v for r in timeline["ranks"])
        for b in measured_bubbles(timeline):
            assert 0.0 <= b["bubble"] < 1.0 and b["busy_s"] > 0
        # Activations held at once, counted in the runner, are what the validator predicts: GPipe holds all
        # m micro-batches, 1F1B (and ZB-H1) at most p - rank; a micro-batch's are freed at its backward.
        expected = simulate(build_schedule(name, 2, 4, v)).peak_in_flight
        assert [r["peak_in_flight"] for r in timeline["ranks"]] == expected
        # (chunks for interleaved and the V schedules: ZB-V's 2p chunks are 1F1B's p stages, DualPipeV's 2p + 1)
        assert expected == {"gpipe": [4, 4], "1f1b": [2, 1], "zb-h1": [2, 1], "interleaved": [5, 3], "zb-v": [4, 4],
                            "dualpipev": [5, 5]}[name]
    run = tmp_path / "run"
    run.mkdir()
    (run / "timeline.json").write_text(json.dumps(timelines["zb-h1"]))
    assert cli_main(["report", str(run)]) == 0
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (run / "bubbles.md").read_text()
    assert "Schedule **zb-h1**, p = 2, m = 4" in table
    assert len([line for line in table.splitlines() if line[:3] in ("| 0", "| 1")]) == 2  # one row per rank
    assert cli_main(["report", str(tmp_path)]) == 1  # no timeline there


def test_train_command_writes_a_timeline_for_a_pipeline(tmp_path):
    config = json.loads((ROOT / "configs" / "demo.json").read_text())
    config["trainer"].update(model="gpt-tiny", steps=4, eval_every=4, eval_batches=2, progress_bar=False)
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4, steps_per_print=2,
                  pipeline={"stages": 2, "schedule": "zb-h1"})
    (tmp_path / "c.json").write_text(json.dumps(config))
    run = _paratrain("train", "--config", "c.json", "--run-dir", "out", "--nproc-per-node", "2",
                     "--master-port", _free_port(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["layout"] == "pp2" and summary["last_loss"] < summary["first_loss"]
    timeline = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert timeline["schedule"] == "zb-h1" and len(timeline["ranks"]) == 2
    report = _paratrain("report", "out", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "measured bubble" in report.stdout and (tmp_path / "out" / "timeline.png").is_file()
    # the metrics part of the same report: pictures and a summary with every rank's memory
    assert all((tmp_path / "out" / f"{name}.png").is_file() for name in ("loss", "throughput", "memory", "comm"))
    assert "layout pp2 on 2 process(es)" in report.stdout and "- peak RSS per rank:" in report.stdout

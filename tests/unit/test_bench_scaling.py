"""benchmarks/scaling.py without measuring: the formulas it compares against, which points it runs, and that
its report (tables, sentences, images, doc section) is built from any full-plan result (nothing is timed)."""

from __future__ import annotations

from benchmarks import scaling
from benchmarks.common import expected_setup


def test_formulas_are_the_fp32_adamw_model_state_per_rank():
    psi, n = 1000, 4
    assert scaling.formula_bytes("DDP", psi, n) == 16 * psi
    assert scaling.formula_bytes("ZeRO-1", psi, n) == 8 * psi + 8 * psi // n
    assert scaling.formula_bytes("ZeRO-2", psi, n) == 4 * psi + 12 * psi // n
    assert scaling.formula_bytes("ZeRO-3", psi, n) == 16 * psi // n
    assert scaling.formula_bytes("TP", psi, n) == scaling.formula_bytes("PP", psi, n) == 16 * psi // n
    assert scaling.formula_bytes("ZeRO-3", 1001, n) == 16 * 251  # shards padded to a multiple of N
    assert all(scaling.formula_bytes(s, psi, 1) == 16 * psi for s in scaling.STRATEGIES)


def test_the_full_plan_runs_every_strategy_at_every_world_above_one():
    plan = scaling.FULL
    for world in plan["worlds"]:
        for s in scaling.STRATEGIES:
            reason = scaling.skip_reason(s, world, plan["world_model"], plan["global_batch"])
            assert reason == (scaling.SAME_AS_DDP if world == 1 and s != "DDP" else None), (s, world)
    for model in plan["size_models"]:
        assert not any(scaling.skip_reason(s, plan["size_world"], model, plan["global_batch"])
                       for s in scaling.STRATEGIES)
    assert "do not fill 8 stages" in scaling.skip_reason("PP", 8, {"n_layer": 4}, 16)
    assert "not divisible by 8" in scaling.skip_reason("TP", 8, {"n_head": 4, "d_model": 128}, 16)
    assert "does not split" in scaling.skip_reason("ZeRO-2", 8, {}, 12)


def _fake_measure(strategy, world, model, global_batch, steps, warmup):
    psi = scaling.model_config(model).num_params()
    state = scaling.formula_bytes(strategy, psi, world) + (64 * world if strategy in ("TP", "PP") else 0)
    point = {"strategy": strategy, "world": world, "model": model, "params": psi, "median_step_s": 0.1 * world,
             "state_bytes": state, "formula_bytes": scaling.formula_bytes(strategy, psi, world),
             "peak_rss": 300 * 2**20, "last_loss": 5.0, "setup": expected_setup()}
    if strategy in ("TP", "PP"):
        point["rank_formula_bytes"] = state
    return point


def test_report_of_a_full_plan_result(monkeypatch, tmp_path):
    monkeypatch.setattr(scaling, "measure", _fake_measure)
    plan, done = scaling.FULL, {}
    a = scaling.run_curve("world", [(s, w, plan["world_model"]) for w in plan["worlds"] for s in scaling.STRATEGIES],
                          16, 1, 0, done, 0.0)
    b = scaling.run_curve("model", [(s, 4, m) for m in plan["size_models"] for s in scaling.STRATEGIES],
                          16, 1, 0, done, 0.0)
    assert len(done) == 1 + 6 * 3 + 6 * 3  # world 1 measured once (DDP), the rest reuse it
    assert [p.get("reused_from") for p in a[:6]] == [None] + ["DDP"] * 5
    result = {"date": "today", "machine": "m", "steps": 1, "warmup": 0, "curve_world": a, "curve_model": b,
              **{k: plan[k] for k in ("global_batch", "world_model", "size_world", "size_models")}}
    text = scaling.section(result, "python -m benchmarks.scaling", "images")
    assert text.startswith(scaling.MARK) and text.endswith(scaling.END_MARK)
    assert text.count("| ZeRO-3 | 8 | 800 |") == 1 and "exactly at all 37 measured points" in text
    scaling.plot(a, "world", tmp_path / "w.png", "world")
    assert (tmp_path / "w.png").stat().st_size > 1000

    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{scaling.MARK}\nold\n{scaling.END_MARK}\n\nafter\n")
    scaling.write_section(doc, text)
    assert doc.read_text() == f"# B\n\nbefore\n\n{text}\n\nafter\n"
    doc.write_text("# B\n\nonly\n")
    scaling.write_section(doc, text)
    assert doc.read_text() == f"# B\n\nonly\n\n{text}\n"


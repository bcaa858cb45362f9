"""Muon in every layout against one process running torch's Muon + AdamW on the same groups (fp32, clipping
active): each world runs its whole list of layouts in one call."""

from __future__ import annotations

import pytest

from paratrain.testing import max_rel_diff, rel_diff
from paratrain.testing.parity import TOLERANCE, compare, layout_parity, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import corpus_windows, tiny_gpt
from tests.real_data import RealRows, documents_loss

pytestmark = pytest.mark.multiprocess

STEPS = 4
GLOBAL_BATCH = 8
# float32 Newton-Schulz: in torch's bfloat16 the iteration flips on float32 rounding of its input (see the note
# in paratrain/muon/newton_schulz.py), so no two layouts could be compared at 1e-5.
MUON = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.05, "ns_dtype": "float32",
                                   "adamw": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6}}}


def muon_config(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False, micro_batch: int = 2,
                **zero_extra) -> dict:
    return {"optimizer": MUON, "gradient_clipping": 0.5, "seed": 7,
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": GLOBAL_BATCH // (micro_batch * dp),
            "tensor_parallel": {"size": tp, "sequence_parallel": sp},
            "pipeline": {"stages": pp, "partition": "uniform"},
            "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0, **zero_extra}}


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["losses"][-1] < r["losses"][0], r


# Matrices each rank orthogonalizes per step (docs/muon.md, "Owners' balance"; benchmarks/results/muon_parity.json):
# the tiny GPT's 12 (6 per pipeline stage) on every rank under DDP, split evenly over dp (and edp) under ZeRO; the
# tiny Mixtral's 8 dense matrices and 2 x 6 local experts per rank at ep2: all 20 under DDP, 2 + 6 under ZeRO.
NS_PER_STEP = {"dp2": 12, "dp2 zero1": 6, "dp2 zero2": 6, "dp2 zero3": 6, "dp2 zero3 zero.Init": 6,
               "dp2 x tp2 sp": 12, "dp2 x tp2 zero1 sp": 6, "dp2 x pp2 1f1b": 6, "dp2 x pp2 zero2 1f1b": 3,
               "dp4 (ep2 folded in dp x cp)": 20, "dp4 (ep2 folded in dp x cp) zero1": 8,
               "dp4 (ep2 folded in dp x cp) zero3": 8, "dp2 x pp2 x tp2 1f1b": 6, "dp2 x pp2 x tp2 zero1 1f1b": 3}


def _check_work(runs: list[list[dict]]) -> None:
    """Every rank orthogonalized its share of the matrices on every step (Muon, not momentum SGD: DeepSpeed#8442)."""
    for results in runs:
        for r in results:
            assert r["is_muon"] and r["ns_matrices"] == NS_PER_STEP[r["case"]] * STEPS, r


WORLD2 = [muon_config(dp=2), muon_config(dp=2, zero=1), muon_config(dp=2, zero=2), muon_config(dp=2, zero=3),
          muon_config(dp=2, zero=3, offload_optimizer={"device": "cpu"})]


def _built_under_zero_init():
    import paratrain

    with paratrain.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = tiny_gpt()
    assert all(p.is_meta for p in model.parameters())
    return model


def _matrix2() -> list[dict]:
    data, references = corpus_windows(), {}
    out = [layout_parity(cfg, tiny_gpt, data, STEPS, references=references, inspect=_muon_work) for cfg in WORLD2]
    # DeepSpeed#8438: a model built under zero.Init (here: on meta, materialized by the engine) gets Muon too.
    run = run_layout(muon_config(dp=2, zero=3), _built_under_zero_init, data, STEPS, inspect=_muon_work)
    ref = reference_run(tiny_gpt, reference_config(muon_config(dp=2, zero=3), run), data, STEPS)
    out.append({"case": run.case + " zero.Init", **summarize(compare(run, ref)), "losses": run.losses, **run.extra})
    return out


def _deepspeed_style_groups(model) -> list[dict]:
    """Groups as a DeepSpeed Muon script passes them: use_muon and options of their own."""
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for p in model.parameters() if not any(p is q for q in matrices)]
    return [{"params": matrices, "use_muon": True, "lr": 0.03}, {"params": rest, "use_muon": False,
                                                                 "weight_decay": 0.0}]


def _groups_and_bf16() -> list[dict]:
    """ZeRO-2 with DeepSpeed-style groups (against the reference on the same groups), ZeRO-1 on masked rows whose
    target counts differ between the ranks (against one process dividing by the global count), bf16 ZeRO-1 and
    torch's own bfloat16 iteration (`_bf16`, `_torch_bfloat16`)."""
    data = corpus_windows()
    groups = layout_parity(muon_config(dp=2, zero=2), tiny_gpt, data, STEPS, model_parameters=_deepspeed_style_groups)
    rows = RealRows("masked")
    run = run_layout(muon_config(dp=2, zero=1), tiny_gpt, rows, STEPS)
    ref = reference_run(tiny_gpt, reference_config(muon_config(dp=2, zero=1), run), rows, STEPS,
                        loss_of=documents_loss)
    real = {"case": run.case + " masked rows", **summarize(compare(run, ref)), "losses": run.losses}
    return [{**groups, "case": groups["case"] + " deepspeed groups"}, real, _bf16(data), _torch_bfloat16(data)]


def _bf16(data) -> dict:
    """bf16 ZeRO-1 (fp32 masters) against one process in bf16, and how far one process in fp32 is from that."""
    cfg = {**muon_config(dp=2, zero=1), "bf16": {"enabled": True}}
    run = run_layout(cfg, tiny_gpt, data, STEPS)
    ref = reference_run(tiny_gpt, reference_config(cfg, run), data, STEPS)
    fp32 = reference_run(tiny_gpt, reference_config(muon_config(dp=2, zero=1), run), data, STEPS)
    return {"case": run.case, **summarize(compare(run, ref, TOLERANCE["bf16"])), "losses": run.losses,
            "fp32_loss_err": max(rel_diff(a, b) for a, b in zip(fp32.losses, ref.losses)),
            "fp32_param_err": max_rel_diff(fp32.state, ref.state)[0]}


def _torch_bfloat16(data) -> dict:
    """dp2 ZeRO-1 with torch's own bfloat16 iteration, against torch.optim.Muon itself in one process."""
    cfg = muon_config(dp=2, zero=1)
    cfg["optimizer"] = {**MUON, "params": {k: v for k, v in MUON["params"].items() if k != "ns_dtype"}}
    return {**layout_parity(cfg, tiny_gpt, data, STEPS), "case": "dp2 zero1 ns_dtype bfloat16"}


def test_muon_parity_data_parallel_and_zero_init(world2):
    runs = world2.run(_matrix2)
    _check_work(runs)
    for results in runs:
        _check(results)
        assert [r["case"] for r in results] == ["dp2", "dp2 zero1", "dp2 zero2", "dp2 zero3", "dp2 zero3",
                                                "dp2 zero3 zero.Init"]
    groups, real, bf16, default = world2.run(_groups_and_bf16)[0]
    _check([groups, real])  # real: a gradient scaled by the rank's own token count moves the norm, not the weights
    # bf16: the loss within 5e-5 of one process in bf16, where one process in fp32 is further away (the bound
    # tells them apart); the weights only within 0.1: Newton-Schulz spreads bf16's rounding of the gradient over
    # the matrix, about as far as the fp32 process's distance, so weights cannot tell them apart. Each step's
    # gradient norm within 2e-3: the loss's weighting. (Numbers: benchmarks/results/muon_parity.json.)
    assert bf16["loss_err"] <= 5e-5 < bf16["fp32_loss_err"] and bf16["param_err"] <= 0.1, bf16
    assert bf16["norm_err"] <= 2e-3 and bf16["losses"][-1] < bf16["losses"][0], bf16
    # torch's default (bfloat16) against torch's Muon: close, not exact; the iteration rounds float32 differences
    # into bfloat16 neighbours (docs/muon.md, "Exact in every layout": why the cases above run it in float32)
    assert default["loss_err"] <= 1e-4 and default["param_err"] <= 5e-2 and default["norm_err"] <= 1e-3, default
    assert default["losses"][-1] < default["losses"][0], default


def _muon_work(engine) -> dict:
    """What the step did with Muon on this rank: the optimizer, matrices orthogonalized, Muon's collectives."""
    from paratrain.muon import Muon

    stats = engine.comm_stats(by_tag=True)
    muon = {f"{axis}.{op}": tags["muon"]["calls"] for axis, ops in stats.items() for op, tags in ops.items()
            if "muon" in tags}
    opt = engine.optimizer
    return {"optimizer": type(opt).__name__, "is_muon": isinstance(opt, Muon),
            "ns_matrices": opt.matrices.work.matrices if isinstance(opt, Muon) else 0, "muon_comm": muon}


# [Note: the router on AdamW here] A softmax router's gradient has rows summing to zero (a shift shared by all
# experts changes no probability), so one direction of its (experts, d) matrix is exactly zero but for rounding,
# and Newton-Schulz scales that direction up ~3.4445^5 = 487x: two correct runs then differ by their rounding
# noise times up to 487, more than a 1e-5 comparison can absorb. The router is a dense matrix like any other
# here (the GPT cases prove those); on AdamW, the comparison weighs the expert matrices.
ROUTER = ["*.mlp.gate.gate.weight"]


def _moe_model():
    from tests.distributed.test_expert_parallel import moe_model

    return moe_model()


def _matrix4() -> list[dict]:
    data, references, out = corpus_windows(), {}, []
    for cfg in (muon_config(dp=2, tp=2, sp=True), muon_config(dp=2, tp=2, zero=1, sp=True),
                muon_config(dp=2, pp=2), muon_config(dp=2, pp=2, zero=2)):
        out.append(layout_parity(cfg, tiny_gpt, data, STEPS, references=references, inspect=_muon_work))
    for zero in (0, 1, 3):  # ep2 inside dp4: the experts' matrices sharded over edp2, the rest over dp4
        cfg = {**muon_config(dp=4, zero=zero, micro_batch=1), "expert_parallel": {"size": 2}}
        cfg["optimizer"] = {**MUON, "params": {**MUON["params"], "adamw_names": ROUTER}}
        out.append(layout_parity(cfg, _moe_model, data, STEPS, references=references, inspect=_muon_work))
    return out


def test_muon_parity_tensor_pipeline_and_expert_parallel(world4):
    runs = world4.run(_matrix4)
    _check_work(runs)
    for results in runs:
        _check(results)


def _matrix8() -> list[dict]:
    data = corpus_windows()
    return [layout_parity(muon_config(dp=2, pp=2, tp=2, zero=zero), tiny_gpt, data, STEPS, inspect=_muon_work)
            for zero in (0, 1)]


def test_muon_parity_dp_pp_tp(world8):
    runs = world8.run(_matrix8)
    _check_work(runs)
    for results in runs:
        _check(results)


def _legs(legs: list[tuple[str | None, str, dict, int]]) -> list[dict]:
    """Each leg: load from `src` (None: start fresh), train `steps`, save to `dst`."""
    import paratrain

    out = []
    for src, dst, cfg, steps in legs:
        engine, *_ = paratrain.initialize(model=tiny_gpt(seed=1 if src is None else 5), config=cfg,
                                          training_data=corpus_windows())
        if src is not None:
            engine.load_checkpoint(src)
        losses = [float(engine.train_batch()) for _ in range(steps)]
        engine.save_checkpoint(dst)
        out.append({"losses": losses, "state": engine.full_state_dict(), "layout": engine.mesh.dims.describe()})
        engine.destroy()
    return out


def test_muon_momentum_reshards_across_layouts(world4, tmp_path):
    """Two steps in dp2 x tp2 ZeRO-1, one in dp4 ZeRO-3, one in dp2 x pp2 DDP: the losses and weights of four
    steps in one process (the momentum buffers travel in the checkpoint, resharded like Adam's moments)."""
    d = [str(tmp_path / f"leg{i}") for i in range(3)]
    legs = world4.run(_legs, [(None, d[0], muon_config(dp=2, tp=2, zero=1), 2),
                              (d[0], d[1], muon_config(dp=4, zero=3, micro_batch=1), 1),
                              (d[1], d[2], muon_config(dp=2, pp=2), 1)])[0]
    assert [leg["layout"] for leg in legs] == ["dp2 x tp2", "dp4", "dp2 x pp2"]
    ref = reference_run(tiny_gpt, {**muon_config(), "train_batch_size": GLOBAL_BATCH}, corpus_windows(), STEPS)
    losses = [x for leg in legs for x in leg["losses"]]
    errors = [rel_diff(a, b) for a, b in zip(losses, ref.losses)]
    param_err, where = max_rel_diff(legs[-1]["state"], ref.state)
    assert max(errors) <= 1e-5 and param_err <= 1e-5, (errors, param_err, where)

"""Planner, an objective's reference model: where its log-probs come from (the engine's own rule), the frozen copy's
bytes by layout (equal to `engine.memory_stats()`'s reference_params: tests/distributed/test_objectives.py), its
forward's transient memory and FLOPs, and the CLI's flags and config section."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from paratrain.cli import main
from paratrain.planner.adapters import LoraPlan, projections
from paratrain.planner.layout import Layout
from paratrain.planner.memory import activation_parts, estimate_memory, rank_params, recompute_bytes, reference_bytes
from paratrain.planner.model_shape import PlannerError, model_shape, with_adapters, with_reference
from paratrain.planner.reference import ReferencePlan, resolve_reference
from paratrain.planner.step_time import stage_flops_per_token

LLAMA = model_shape("llama-mini")
DPO = ReferencePlan({"type": "dpo"}, "initial")


def _lora(shape):
    return with_adapters(shape, LoraPlan(4, tuple(projections(shape))))


def test_the_reference_mode_is_the_engines():
    assert resolve_reference({"type": "dpo"}, False, "x").mode == "initial"
    assert resolve_reference({"type": "dpo"}, True, "x").mode == "adapters_off"
    assert resolve_reference({"type": "dpo", "reference": "batch"}, False, "x").mode == "batch"
    assert resolve_reference({"type": "dpo", "reference_model": "/some/dir"}, False, "x").mode == "initial"
    assert resolve_reference({"type": "grpo"}, False, "x").mode == "none"  # beta 0: no reference
    assert resolve_reference({"type": "grpo", "beta": 0.04}, False, "x").mode == "initial"
    assert resolve_reference({"type": "sft"}, False, "x") is None
    with pytest.raises(PlannerError, match="--reference: .*adapters_off.* but the model has no adapters"):
        resolve_reference({"type": "dpo", "reference": "adapters_off"}, False, "--reference")
    with pytest.raises(PlannerError, match="--reference: a reference belongs to the dpo and grpo objectives"):
        resolve_reference({"reference": "initial"}, False, "--reference")
    with pytest.raises(PlannerError, match="adapters is not costed"):
        resolve_reference({"type": "dpo", "reference": "initial"}, True, "--reference")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_frozen_copy_is_placed_like_a_frozen_weight(zero):
    """Compute-dtype bytes of the rank's piece: whole at ZeRO 0-2, a padded shard of each unit at ZeRO-3."""
    shape = with_reference(LLAMA, DPO)
    layout = Layout(dp=4, micro_batch=1, grad_accum=2, tp=2, zero_stage=zero, precision="bf16")
    piece = rank_params(shape, layout, 0)
    got = reference_bytes(shape, layout, 0)
    if zero < 3:
        assert got == 2 * piece
    else:  # each of the blocks and the root (embedding, final norm, head) padded to a multiple of 4 apart
        units = [shape.layer_params(2)] * shape.n_layer + [piece - shape.n_layer * shape.layer_params(2)]
        assert got == 2 * sum(-(-u // 4) for u in units)
        assert 2 * piece / 4 <= got <= 2 * piece / 4 + 2 * len(units)
    assert reference_bytes(LLAMA, layout, 0) == 0  # no objective: no copy
    memory, without = estimate_memory(shape, layout), estimate_memory(LLAMA, layout)
    assert memory.reference == got and memory.params == without.params + got  # counted in params, as memory_stats


def test_a_pipeline_partitions_the_copy():
    shape = with_reference(LLAMA, DPO)
    layout = Layout(dp=2, micro_batch=1, grad_accum=4, pp=2, schedule="1f1b", zero_stage=1, precision="fp32")
    assert [reference_bytes(shape, layout, s) for s in (0, 1)] == [4 * rank_params(shape, layout, s) for s in (0, 1)]


def test_adapters_off_and_precomputed_references_cost_no_copy():
    layout = Layout(dp=2, micro_batch=1, grad_accum=2, zero_stage=3, precision="bf16")
    for shape in (with_reference(_lora(LLAMA), ReferencePlan({"type": "dpo"}, "adapters_off")),
                  with_reference(LLAMA, ReferencePlan({"type": "dpo", "reference": "batch"}, "batch"))):
        assert reference_bytes(shape, layout, 0) == 0


def test_the_reference_forward_holds_one_layer_and_costs_a_forward():
    """Under no_grad it keeps nothing, but builds one layer's activations at a time, like full recompute's
    backward (and never with it); its FLOPs are a forward's."""
    layout = Layout(dp=2, micro_batch=2, grad_accum=2, zero_stage=1, precision="bf16")
    shape = with_reference(LLAMA, DPO)
    layer = recompute_bytes(LLAMA, activation_parts(LLAMA, layout, True, "none"))
    assert estimate_memory(shape, layout).transient == estimate_memory(LLAMA, layout).transient + layer
    assert estimate_memory(shape, layout).activations == estimate_memory(LLAMA, layout).activations
    full = replace(layout, recompute="full")
    assert estimate_memory(shape, full).transient == estimate_memory(LLAMA, full).transient
    batch = with_reference(LLAMA, ReferencePlan({"type": "dpo", "reference": "batch"}, "batch"))
    assert estimate_memory(batch, layout).transient == estimate_memory(LLAMA, layout).transient
    train, forward = stage_flops_per_token(LLAMA, layout, 0), stage_flops_per_token(shape, layout, 0)
    assert forward == pytest.approx(train * 4 / 3)  # a forward is a third of forward + backward
    assert stage_flops_per_token(batch, layout, 0) == train


def test_cli_costs_the_reference_from_flags_and_from_a_config(tmp_path, capsys):
    args = ["plan", "--model", "llama-mini", "--gpus", "4", "--gpu-memory", "80GiB", "--global-batch", "8", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "reference" not in plain["ranked"][0]["memory"] and "objective" not in plain["config"]
    assert main(args + ["--objective", "dpo", "--top", "50"]) == 0
    dpo = json.loads(capsys.readouterr().out)
    best = dpo["ranked"][0]
    assert best["memory"]["reference"] > 0 and dpo["config"]["objective"] == {"type": "dpo"}
    config = tmp_path / "dpo.json"
    config.write_text(json.dumps({"trainer": {"model": "llama-mini"}, "objective": {"type": "dpo", "beta": 0.2}}))
    assert main(["plan", "--model", str(config), "--gpus", "4", "--global-batch", "8", "--json"]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert from_config["config"]["objective"] == {"type": "dpo", "beta": 0.2}
    assert from_config["ranked"][0]["memory"]["reference"] > 0
    assert main(["plan", "--model", str(config), "--gpus", "4", "--global-batch", "8", "--json",
                 "--reference", "batch"]) == 0
    assert json.loads(capsys.readouterr().out)["ranked"][0]["memory"]["reference"] == 0  # precomputed: no copy
    assert main(args + ["--reference", "adapters_off", "--objective", "dpo"]) == 2
    assert "--objective/--reference: objective.reference is \"adapters_off\" but the model has no adapters" in \
        capsys.readouterr().err

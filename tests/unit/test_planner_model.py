"""Planner, model shape: parameter counts (total, per tensor-parallel shard, per pipeline stage), flags."""

from __future__ import annotations

import fnmatch
import json

import pytest
import torch

from paratrain.models.gpt.model import GPT, PRESETS, GPTConfig
from paratrain.models.gpt.spec import GPT_PLAN
from paratrain.planner.layout import Layout
from paratrain.planner.memory import rank_params
from paratrain.planner.model_shape import PlannerError, model_shape, shape_from_config
from paratrain.planner.stages import stage_layers
from paratrain.planner.units import parse_bytes, parse_rate, parse_seconds


@pytest.mark.parametrize("name", list(PRESETS))
def test_pieces_add_up_to_num_params(name):
    spec = model_shape(name)
    assert spec.params == PRESETS[name].num_params()
    assert spec.n_layer * spec.layer_params() + spec.embed_params() + spec.head_params() == spec.params


def _shard_of(name: str, param: torch.Tensor, tp: int) -> int:
    """What one tp rank holds of `param` under the GPT's own TP plan (the one training uses): colwise and vocab
    styles split everything, rowwise the weight."""
    module = name.rsplit(".", 1)[0]
    style = next((s for pattern, s in GPT_PLAN.items() if fnmatch.fnmatch(module, pattern)), None)
    if style in ("colwise", "colwise_vocab", "vocab") or (style == "rowwise" and name.endswith("weight")):
        return param.numel() // tp
    return param.numel()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_split_matches_the_plan_on_a_real_model(bias, tp):
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=4, d_model=16, d_ff=40, bias=bias)
    model = GPT(cfg)
    spec = shape_from_config(cfg)
    held = {name: _shard_of(name, p, tp) for name, p in model.named_parameters()}
    block0 = sum(v for k, v in held.items() if k.startswith("blocks.0."))
    embed = sum(v for k, v in held.items() if k.startswith("embed."))
    head = sum(v for k, v in held.items() if k.startswith(("ln_f.", "head.")))
    assert (block0, embed, head) == (spec.layer_params(tp), spec.embed_params(tp), spec.head_params(tp))
    for stages in (1, 2, 3):
        layout = Layout(dp=1, micro_batch=1, grad_accum=1, tp=tp, pp=stages, schedule="1f1b" if stages > 1 else "none")
        assert sum(rank_params(spec, layout, s) for s in range(stages)) == sum(held.values())


def test_stage_layers_uniform_split():
    assert stage_layers(32, 4) == [8, 8, 8, 8]
    assert stage_layers(10, 4) == [3, 3, 2, 2]
    assert stage_layers(80, 1) == [80]


def test_largest_module_is_what_deepspeed_would_find():
    cfg = GPTConfig(vocab_size=300, seq_len=8, n_layer=2, n_head=4, d_model=16, d_ff=40, bias=True)
    model = GPT(cfg)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape_from_config(cfg).largest_module_params() == largest


def test_model_from_a_config_file_with_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 64,
                                "trainer": {"model": "gpt-small", "model_overrides": {"n_layer": 3}}}))
    spec = model_shape(str(path))
    assert spec.name == "gpt-small" and spec.n_layer == 3 and spec.overrides == {"n_layer": 3}
    assert model_shape(str(path), seq_len=64).seq_len == 64
    assert model_shape("gpt-7b", seq_len=8192).overrides == {"seq_len": 8192}
    tiny = shape_from_config(GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=False),
                            "gpt-tiny")
    assert tiny.overrides == {"bias": False}


def test_bad_model_names_the_choices(tmp_path):
    with pytest.raises(PlannerError, match="neither a GPT preset .*gpt-7b"):
        model_shape("gpt-8b")
    (tmp_path / "bad.json").write_text(json.dumps({"trainer": {"model": "gpt-tiny", "model_overrides": {"x": 1}}}))
    with pytest.raises(PlannerError, match="unknown GPTConfig field"):
        model_shape(str(tmp_path / "bad.json"))


def test_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141GB") == 141e9
    assert parse_bytes("1024") == 1024
    assert parse_rate("300GB/s", "--x") == 300e9
    assert parse_rate("400Gb/s", "--x") == parse_rate("400Gbps", "--x") == 50e9
    assert parse_rate("25GiB/s", "--x") == 25 * 2**30
    assert parse_seconds("10us") == pytest.approx(1e-5)
    assert parse_seconds("2ms") == pytest.approx(2e-3)
    with pytest.raises(PlannerError, match="--gpu-memory '80 gigs'"):
        parse_bytes("80 gigs")
    with pytest.raises(PlannerError, match="unknown unit"):
        parse_seconds("3h")

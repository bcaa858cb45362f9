"""Config validation: every error class names the key, the value and the fix."""

import json

import pytest

from paratrain.api import resolve_config
from paratrain.config import ConfigError, load_config, resolve_batch


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match="unknown config key 'train_batch_sise'; did you mean 'train_batch_size'"):
        load_config({"train_batch_sise": 8})
    with pytest.raises(ConfigError, match="'zero_optimization.reduce_bukcet_size'; did you mean "
                                          "'zero_optimization.reduce_bucket_size'"):
        load_config({"zero_optimization": {"reduce_bukcet_size": 3}})


def test_out_of_range_values_name_key_and_value():
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage' = 4: Input should be less than or equal to 3"):
        load_config({"zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match=r"'gradient_clipping' = -1"):
        load_config({"gradient_clipping": -1})


def test_batch_arithmetic_mismatch_shows_the_numbers():
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match=r"32 != 4 x 2 x 2 = 16. Fix: set train_batch_size to 16"):
        resolve_batch(cfg, 2)


@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 4, (48, 4, 3)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 2}, 8, (16, 2, 1)),
])
def test_any_two_batch_keys_give_the_third(given, world, expected):
    cfg = resolve_batch(load_config(given), world)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected


def test_indivisible_batch_is_explained():
    with pytest.raises(ConfigError, match=r"train_batch_size \(30\) is not divisible by "
                                          r"train_micro_batch_size_per_gpu \(4\) x data-parallel size \(2\) = 8"):
        resolve_batch(load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}), 2)
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch(load_config({}), 2)


def test_parallel_sizes_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"does not divide the world size 6"):
        resolve_batch(load_config({"train_batch_size": 8, "tensor_parallel": {"size": 4}}), 6)
    with pytest.raises(ConfigError, match=r"set data_parallel.size to 4 or -1"):
        resolve_batch(load_config({"train_batch_size": 8, "data_parallel": {"size": 2}}), 4)


def test_json_file_and_bad_json(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    assert load_config(str(good)).optimizer.type == "SGD"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")


def test_deepspeed_features_we_do_not_have_are_named():
    with pytest.raises(ConfigError, match="'flops_profiler' is a DeepSpeed feature paratrain does not support"):
        load_config({"flops_profiler": {"enabled": True}})
    load_config({"flops_profiler": {"enabled": False}})  # disabled: no difference from DeepSpeed


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ConfigError, match="set the top-level 'gradient_clipping'"):
        load_config({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})


def test_fp16_and_bf16_together_rejected():
    with pytest.raises(ConfigError, match="enable at most one"):
        load_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_resolve_config_is_pure_and_complete():
    cfg = resolve_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2)
    assert cfg.train_batch_size == 8 and cfg.dp_size(2) == 2


def test_config_reference_in_docs_is_current():
    from pathlib import Path

    from paratrain.config.reference import generate

    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert generate() in doc, "docs/config.md is stale: run python -m paratrain.config.reference --write docs/config.md"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_resolved_config_loads_again_at_every_stage(stage):
    # A run writes its resolved config (every field, defaults included) to config.json; loading that file must
    # not trip the checks that refuse options set at stages they do nothing at.
    resolved = load_config({"zero_optimization": {"stage": stage}}).model_dump(mode="json")
    assert load_config(resolved).model_dump(mode="json") == resolved


def test_the_v_schedules_default_to_their_two_chunks_per_rank():
    from paratrain.config import load_config

    for schedule in ("zb-v", "dualpipev"):  # left out: 2, the only value that works for a V
        assert load_config({"pipeline": {"stages": 2, "schedule": schedule}}).pipeline.virtual_stages == 2
    assert load_config({"pipeline": {"stages": 2, "schedule": "interleaved"}}).pipeline.virtual_stages == 1
    assert load_config({"pipeline": {"stages": 2, "schedule": "zb-v", "virtual_stages": 1}}).pipeline.virtual_stages \
        == 1  # written out: kept, and refused by the schedule with the fix (test_pipeline_schedules.py)

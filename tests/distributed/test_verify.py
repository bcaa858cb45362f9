"""`paratrain verify`: exits 0 on correct layouts (the built-in GPT shrunk, and a user model named by an
importable factory) and non-zero on a deliberately broken one, through the real CLI."""

from __future__ import annotations

import json

import pytest

from paratrain.config import load_config
from paratrain.models import GPT_PLAN
from paratrain.testing.verify import default_world_size, small_instance, verify_config
from tests.cases import adamw_config
from tests.distributed.test_cli import _paratrain
from tests.distributed.test_tp import LLAMA_PLAN


def _write(tmp_path, name: str, config: dict) -> str:
    (tmp_path / name).write_text(json.dumps(config))
    return name


def test_small_instance_keeps_the_layouts_divisibility():
    cfg = load_config({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
                       "tensor_parallel": {"size": 8, "sequence_parallel": True}, "context_parallel": {"size": 2},
                       "pipeline": {"stages": 2, "schedule": "interleaved", "virtual_stages": 2},
                       "trainer": {"model": "gpt-70b"}})
    gpt = small_instance(cfg).gpt
    assert (gpt["n_layer"], gpt["n_head"], gpt["d_model"], gpt["d_ff"]) == (4, 8, 64, 256)
    assert gpt["seq_len"] % (2 * 2) == 0 and gpt["seq_len"] % (2 * 8) == 0 and gpt["vocab_size"] == 256
    assert (gpt["dropout"], gpt["bias"]) == (0.0, False)
    assert default_world_size(cfg) == 2 * 2 * 2 * 8  # dp = -1: two data-parallel replicas
    run = verify_config(cfg, 64)
    assert (run["train_micro_batch_size_per_gpu"], run["gradient_accumulation_steps"]) == (2, 4)


@pytest.mark.multiprocess
def test_verify_passes_a_hybrid_gpt_layout(tmp_path):
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                       pipeline={"stages": 2, "schedule": "1f1b"}, context_parallel={"size": 2},
                       activation_checkpointing={"enabled": True, "granularity": "full"},
                       data_parallel={"size": 1}, trainer={"model": "gpt-7b"})
    run = _paratrain("verify", "--config", _write(tmp_path, "good.json", cfg), "--steps", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASS: pp2 x cp2 1f1b ckpt:full" in run.stdout
    assert run.stdout.count(" ok") == 3


@pytest.mark.multiprocess
def test_verify_passes_a_user_model_named_by_its_factory(tmp_path):
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, data_parallel={"size": 1},
                       tensor_parallel={"size": 2, "sequence_parallel": True, "plan": LLAMA_PLAN},
                       activation_checkpointing={"enabled": True},
                       trainer={"model": "tests.distributed.test_tp:TinyLlama", "model_overrides": {"vocab": 256}})
    run = _paratrain("verify", "--config", _write(tmp_path, "llama.json", cfg), "--steps", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "model: tests.distributed.test_tp:TinyLlama(vocab=256)" in run.stdout
    assert "PASS: tp2 sp ckpt:full" in run.stdout


@pytest.mark.multiprocess
def test_verify_fails_a_plan_that_leaves_norm_gradients_unsummed(tmp_path):
    """Under sequence parallelism each tp rank's norm gradients cover only its tokens: a plan without the
    'sequence' entries never sums them, so the grad norm, the update and the replicas go wrong."""
    plan = {k: v for k, v in GPT_PLAN.items() if ".ln" not in k}
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, data_parallel={"size": 1},
                       tensor_parallel={"size": 2, "sequence_parallel": True, "plan": plan})
    run = _paratrain("verify", "--config", _write(tmp_path, "bad.json", cfg), "--steps", "2", cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAIL: tp2 sp differs from the single-process reference at step(s) 1, 2" in run.stdout
    assert "tensors replicated over tp differ between tp ranks" in run.stdout


@pytest.mark.multiprocess
def test_verify_reports_a_config_error_without_launching(tmp_path):
    run = _paratrain("verify", "--config", _write(tmp_path, "typo.json", {"train_micro_batch": 2}), cwd=tmp_path)
    assert run.returncode == 2 and "unknown config key 'train_micro_batch'" in run.stderr

"""fp16 loss scaling (DeepSpeed's semantics), overflow skipping on every rank, and the memory estimator."""

from __future__ import annotations

import logging
import random

import pytest
import torch

import paratrain
from paratrain.api import resolve_config
from paratrain.config import ConfigError
from paratrain.precision import DynamicLossScaler, LossScaleError
from paratrain.zero import estimate_memory
from tests.cases import adamw_config, corpus_windows, import_deepspeed, tiny_gpt


def test_dynamic_scale_hysteresis_window_and_minimum():
    s = DynamicLossScaler(2.0**4, window=2, min_scale=4.0, hysteresis=2)
    s.update(True)  # first overflow uses up hysteresis: scale stays
    assert (s.scale, s.cur_hysteresis) == (16.0, 1)
    s.update(True)  # second halves
    assert s.scale == 8.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)  # two clean iterations after the overflow: doubles, hysteresis refills
    assert (s.scale, s.cur_hysteresis) == (16.0, 2)
    low = DynamicLossScaler(4.0, min_scale=4.0, hysteresis=1)
    with pytest.raises(LossScaleError, match="minimum loss scale"):
        low.update(True)


def test_dynamic_scale_equals_deepspeed_on_random_overflow_sequences(monkeypatch):
    loss_scaler = import_deepspeed("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)
    logging.disable(logging.CRITICAL)
    try:
        for trial in range(200):
            rnd = random.Random(trial)
            kw = dict(init_scale=2.0 ** rnd.randint(0, 8), scale_window=rnd.randint(1, 5),
                      min_scale=rnd.choice([0.5, 1.0, 2.0]), delayed_shift=rnd.randint(1, 3),
                      consecutive_hysteresis=rnd.random() < 0.5)
            theirs = loss_scaler.DynamicLossScaler(**kw)
            ours = DynamicLossScaler(kw["init_scale"], kw["scale_window"], kw["min_scale"], kw["delayed_shift"],
                                     kw["consecutive_hysteresis"])
            for _ in range(60):
                overflow = rnd.random() < 0.3
                failed = []
                for update in (theirs.update_scale, ours.update):
                    try:
                        update(overflow)
                        failed.append(False)
                    except Exception:
                        failed.append(True)
                assert failed[0] == failed[1], (trial, kw)
                if failed[0]:
                    break
                assert (theirs.cur_scale, theirs.cur_hysteresis) == (ours.scale, ours.cur_hysteresis), (trial, kw)
    finally:
        logging.disable(logging.NOTSET)


def _overflow(stage: int, initial_scale_power: int = 16) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": stage},
                       fp16={"enabled": True, "initial_scale_power": initial_scale_power, "hysteresis": 1,
                             "min_loss_scale": 1.0},
                       scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 3e-3,
                                                                 "warmup_num_steps": 10, "warmup_type": "linear"}})
    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
    rank = engine.global_rank
    scales, skipped, changed = [], [], []
    try:
        for step in range(4):
            before = engine.full_state_dict()
            x, y = next(loader)
            loss = engine(x, y)
            if step == 2 and rank == 1:  # only rank 1 overflows; every rank must skip
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            after = engine.full_state_dict()
            scales.append(engine.loss_scale())
            skipped.append(engine.skipped_steps)
            changed.append(any(not torch.equal(before[k], after[k]) for k in before))
    except LossScaleError as exc:
        return {"error": str(exc)}
    return {"scales": scales, "skipped": skipped, "changed": changed, "steps": engine.global_steps,
            "lr_iterations": engine.lr_scheduler.last_batch_iteration}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(world2, stage):
    for r in world2.run(_overflow, stage):
        assert r["skipped"] == [0, 0, 1, 1]
        assert r["scales"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        assert r["changed"] == [True, True, False, True]  # the skipped step leaves the weights alone
        assert r["steps"] == 4 and r["lr_iterations"] == 3 - 1  # no LR step on the skipped step


def test_fp16_overflow_at_the_minimum_scale_fails_clearly_on_every_rank(world2):
    for r in world2.run(_overflow, 1, 0):
        assert "overflowed at the minimum loss scale (1)" in r["error"]


def test_estimate_memory_formulas():
    psi, n = 1_000_000, 4
    assert estimate_memory(psi, n, 0)["total"] == 16 * psi
    assert estimate_memory(psi, n, 1)["total"] == 8 * psi + 8 * psi // n
    assert estimate_memory(psi, n, 2)["total"] == 4 * psi + 12 * psi // n
    assert estimate_memory(psi, n, 3)["total"] == 16 * psi // n
    # DeepSpeed's mixed-precision figures: 2+2+12 = 16Ψ (stage 0), 4Ψ + 12Ψ/N (stage 1)
    assert estimate_memory(psi, n, 0, precision="bf16")["total"] == 16 * psi
    assert estimate_memory(psi, n, 1, precision="bf16")["total"] == 4 * psi + 12 * psi // n
    off = estimate_memory(psi, n, 3, "optimizer+param", "bf16")
    assert off["device"] == 0 and off["host"] == 16 * psi // n
    model = tiny_gpt()
    assert estimate_memory(model, 2, 3)["total"] == 8 * sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="not available at stage 1"):
        estimate_memory(psi, n, 1, "optimizer+param")


@pytest.mark.parametrize("zero,message", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs sharded optimizer states; set zero_optimization"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "set zero_optimization.stage to 3 \\(it is 2\\)"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, "also set zero_optimization.offload_optimizer.device"),
])
def test_offload_misconfigurations_name_the_key_and_the_fix(zero, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, 2)

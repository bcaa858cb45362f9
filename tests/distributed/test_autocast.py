"""torch_autocast (DeepSpeed's section): the forward under torch.autocast(bf16) with an fp32 model, in every
strategy, against the single-process reference that runs the same forward under autocast."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import ConfigError, load_config
from paratrain.testing.parity import compare, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import adamw_config, corpus_windows, tiny_gpt

STEPS = 5
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


def test_autocast_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="torch_autocast.enabled with bf16.enabled"):
        load_config(adamw_config(**AUTOCAST, bf16={"enabled": True}))
    with pytest.raises(ConfigError, match="lower_precision_safe_modules is not supported"):
        load_config(adamw_config(torch_autocast={"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}))
    with pytest.raises(ConfigError, match="dtype"):
        load_config(adamw_config(torch_autocast={"enabled": True, "dtype": "float16"}))
    assert load_config(adamw_config(**AUTOCAST)).precision == "fp32"  # the model itself stays fp32


def _forward_dtypes() -> dict:
    """Inside the engine's forward a Linear computes in bf16 while its weight stays fp32."""
    import paratrain

    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=adamw_config(train_micro_batch_size_per_gpu=2,
                                                                             **AUTOCAST))
    linear = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
    seen = []
    linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    idx = torch.randint(0, 256, (2, 17))
    loss = engine(idx[:, :-1], idx[:, 1:])
    engine.backward(loss)
    return {"output": str(seen[0]), "weight": str(linear.weight.dtype), "grad": str(linear.weight.grad.dtype)}


def _parity(cfg: dict, data, reference, fp32_reference) -> dict:
    run = run_layout(cfg, tiny_gpt, data, STEPS)
    rows = compare(run, reference)
    return {**summarize(rows), "first_loss_err": rows[0].loss_err, "losses": run.losses,
            "fp32_first_loss_err": compare(run, fp32_reference)[0].loss_err}


def _autocast_matrix() -> list[dict]:
    data, out = corpus_windows(), []
    layouts = [{"zero_optimization": {"stage": s}} for s in (0, 1, 2, 3)]
    # model parallel on 2 ranks leaves dp = 1: twice the micro-batch keeps the global batch at 8
    layouts += [{"tensor_parallel": {"size": 2, "sequence_parallel": True}, "train_micro_batch_size_per_gpu": 4},
                {"pipeline": {"stages": 2}, "train_micro_batch_size_per_gpu": 4}]
    base = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train_batch_size=8)
    reference = reference_run(tiny_gpt, {**base, **AUTOCAST}, data, STEPS)
    fp32_reference = reference_run(tiny_gpt, base, data, STEPS)  # what the bound must tell autocast apart from
    for layout in layouts:
        cfg = {**base, **AUTOCAST, **layout}
        cfg.pop("train_batch_size")
        out.append({**_parity(cfg, data, reference, fp32_reference), "layout": layout})
    return out


# [Note: autocast tolerances] The reference computes the whole global batch under the same autocast; the
# layouts differ from it by bf16 rounding of differently shaped matmuls alone (parameters, gradients and
# their sums stay fp32). On the first step, before rounding has moved any parameter, that is at most 6.9e-7
# in the loss (TP; 8.6e-8 for DP/ZeRO, 0 for PP), while the same runs differ from the fp32 reference by
# 4.8e-6 (TP) to 5.6e-6: FIRST_LOSS_BOUND lies between, and the test asserts that every layout is at least
# FIRST_LOSS_MARGIN times closer to the autocast reference than to the fp32 one. Over five Adam steps rounding
# noise grows to 7.4e-5 in the loss and 2.2e-2 in the parameters (Adam moves every element whose gradient is
# near zero by ~lr), as large as autocast's own effect on this tiny model (4.6e-5 and 2.7e-2 against the fp32
# reference): the later bounds only catch real errors, they do not tell autocast from fp32. The gradient norm of
# every step stays within 6.2e-4 (TP; 4.4e-4 PP): NORM_BOUND catches a loss weighted wrongly (tens of percent),
# which Adam's parameters barely show.
FIRST_LOSS_BOUND, LOSS_BOUND, PARAM_BOUND, NORM_BOUND = 2e-6, 2e-4, 3e-2, 2e-3
FIRST_LOSS_MARGIN = 5


def test_autocast_computes_in_bf16_with_fp32_weights_and_gradients(world2):
    for r in world2.run(_forward_dtypes):
        assert r == {"output": "torch.bfloat16", "weight": "torch.float32", "grad": "torch.float32"}, r


def test_autocast_parity_in_every_strategy(world2):
    for r in world2.run(_autocast_matrix)[0]:
        assert r["first_loss_err"] <= FIRST_LOSS_BOUND < r["fp32_first_loss_err"], r  # the bound separates
        assert r["fp32_first_loss_err"] >= FIRST_LOSS_MARGIN * r["first_loss_err"], r  # by a margin
        assert r["loss_err"] <= LOSS_BOUND and r["param_err"] <= PARAM_BOUND, r
        assert r["norm_err"] <= NORM_BOUND, r  # every step's gradient norm: the loss's weighting
        assert r["losses"][-1] < r["losses"][0], r


def test_gpu_benchmark_engine_equals_the_plain_amp_loop_on_cpu():
    """benchmarks/gpu_mfu.py's two runners (engine with torch_autocast, plain PyTorch AMP loop) do the same
    training: on a tiny CPU instance their losses agree, so the GPU ratio compares like with like."""
    from benchmarks.gpu_mfu import main

    args = ["--device", "cpu", "--preset", "gpt-tiny", "--seq", "32", "--vocab", "256", "--micro-batch", "2",
            "--steps", "2", "--warmup", "1", "--no-compile", "--precision", "autocast"]
    plain, engine = main([*args, "--plain"]), main(args)
    assert (plain["runner"], engine["runner"]) == ("plain PyTorch", "paratrain engine")
    assert abs(engine["last_loss"] - plain["last_loss"]) <= 1e-6 * abs(plain["last_loss"]), (engine, plain)

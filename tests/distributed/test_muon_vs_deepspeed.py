"""paratrain's Muon against DeepSpeed 0.19.8's (ZeRO-1 and ZeRO-2, 2 ranks, same model, weights, batches, groups).

Without clipping the per-step losses agree within 5e-5 (1.8e-7 on one CPU, 3.5e-5 on another). With clipping they
differ, for a reason this file shows: DeepSpeed's ZeRO-1/2 write Muon's orthogonalized update where the gradient was
(`get_flat_partition`) and then compute the global norm over those updates and clip them, where torch's order (and
paratrain's, and the one-process reference) clips the gradient before the momentum. A one-process run in DeepSpeed's
order (`_deepspeed_order`) reproduces DeepSpeed's clipped losses within 1e-5.

Same groups: DeepSpeed gives Muon every 2-d parameter whose name holds neither "embed" nor "lm_head", so this
GPT's output layer ("head") is Muon's there; `muon_names` gives it to paratrain's Muon too. DeepSpeed's
Newton-Schulz is its Gram variant, in float32 on its CPU accelerator (no float16 there); paratrain's runs torch's
iteration with `ns_dtype: "float32"`: the same mathematics, so they differ by float32 rounding only.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.cases import import_deepspeed

pytestmark = pytest.mark.multiprocess

MODEL = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64, bias=False)
MICRO, STEPS, LR, ADAM_LR, WD = 4, 4, 0.02, 3e-3, 0.1


def _model():
    from paratrain.models import GPT

    torch.manual_seed(0)
    return GPT("gpt-tiny", **MODEL)


def _batches(micro: int, ranks: int, rank: int):
    from benchmarks.common import LocalBatches

    return LocalBatches(micro, ranks, rank, seq_len=MODEL["seq_len"])


def _train(framework: str, stage: int, clip: float) -> list[float]:
    import torch.distributed as dist

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": clip, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}}
    deepspeed_params = {"lr": LR, "momentum": 0.95, "weight_decay": WD, "adam_lr": ADAM_LR, "betas": [0.9, 0.95],
                        "eps": 1e-8}
    if framework == "deepspeed":
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        config["optimizer"] = {"type": "Muon", "params": deepspeed_params}
        model = _model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                          dist_init_required=False)
    elif framework == "paratrain, DeepSpeed's config":  # DeepSpeed's keys, read DeepSpeed's way
        import paratrain

        config["optimizer"] = {"type": "Muon", "params": {**deepspeed_params, "ns_dtype": "float32",
                                                          "muon_names": ["head.weight"]}}
        engine, *_ = paratrain.initialize(model=_model(), config=config)
    else:
        import paratrain

        config["optimizer"] = {"type": "Muon", "params": {
            "lr": LR, "momentum": 0.95, "weight_decay": WD, "ns_dtype": "float32", "muon_names": ["head.weight"],
            "adamw": {"lr": ADAM_LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": WD}}}
        engine, *_ = paratrain.initialize(model=_model(), config=config)
    batches, losses = _batches(MICRO, dist.get_world_size(), dist.get_rank()), []
    for _ in range(STEPS):
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def _both_frameworks() -> dict:
    runs = {(framework, stage, clip): _train(framework, stage, clip)
            for framework in ("deepspeed", "paratrain") for stage in (1, 2) for clip in (0.0, 0.5)}
    runs[("paratrain, DeepSpeed's config", 1, 0.0)] = _train("paratrain, DeepSpeed's config", 1, 0.0)
    return runs


def _deepspeed_order(clip: float) -> list[float]:
    """One process, the whole global batch, DeepSpeed's order: momentum and Newton-Schulz on the raw gradient,
    the global norm over (Muon's updates, AdamW's gradients), both clipped, then the steps."""
    from paratrain.muon.newton_schulz import DEFAULT_COEFFICIENTS, lr_ratio, momentum_update, orthogonalize

    model = _model()
    muon = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for p in model.parameters() if not any(p is q for q in muon)]
    adamw = torch.optim.AdamW(rest, lr=ADAM_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    buffers = [torch.zeros_like(p) for p in muon]
    batches, losses = _batches(2 * MICRO, 1, 0), []
    for _ in range(STEPS):
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for p, buffer in zip(muon, buffers):
                update = momentum_update(p.grad, buffer, 0.95, nesterov=True)
                ratio = lr_ratio(tuple(p.shape), None)
                p.grad = orthogonalize(update, DEFAULT_COEFFICIENTS, 5, 1e-7, torch.float32) * ratio
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
            for p in muon:
                p.mul_(1 - LR * WD)
                p.add_(p.grad, alpha=-LR)
        adamw.step()
        model.zero_grad(set_to_none=True)
    return losses


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_muon_matches_deepspeed_muon_and_the_clipping_order_explains_the_difference(monkeypatch):
    import_deepspeed()
    from paratrain.testing import World

    # DeepSpeed keeps its groups in module globals: its runs share one world of their own, in one call.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with World(2, timeout_s=600) as world:
        runs = world.run(_both_frameworks)[0]
    in_deepspeed_order = _deepspeed_order(0.5)
    for stage in (1, 2):
        plain = _worst(runs[("paratrain", stage, 0.0)], runs[("deepspeed", stage, 0.0)])
        clipped_ds, clipped_ours = runs[("deepspeed", stage, 0.5)], runs[("paratrain", stage, 0.5)]
        print(f"ZeRO-{stage}: no clipping {plain:.1e}; clipped {_worst(clipped_ours, clipped_ds):.1e}, in "
              f"DeepSpeed's order {_worst(in_deepspeed_order, clipped_ds):.1e}")
        # 1.8e-7 on an AMD EPYC, 3.5e-5 on an Intel Xeon (ZeRO-1; the cause is not found: the clipped runs in
        # DeepSpeed's order agree within 1.7e-7 there, and an AdamW eps of 1e-6 only brings it to 1.9e-5)
        assert plain <= 5e-5, runs
        assert _worst(clipped_ours, clipped_ds) > 1e-3, runs  # clipping active: the orders differ ...
        assert _worst(in_deepspeed_order, clipped_ds) <= 1e-5, runs  # ... and DeepSpeed's order is the reason
    # DeepSpeed's config keys (adam_lr, betas and eps of the Adam half, lr and weight_decay shared) mean the same:
    # the same run as paratrain's own config (bit for bit), so the same margin to DeepSpeed as above
    ours = runs[("paratrain, DeepSpeed's config", 1, 0.0)]
    assert ours == runs[("paratrain", 1, 0.0)], runs
    assert _worst(ours, runs[("deepspeed", 1, 0.0)]) <= 5e-5, runs

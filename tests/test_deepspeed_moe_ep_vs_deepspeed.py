"""paratrain's `deepspeed.moe.layer.MoE(ep_size=2)` against real DeepSpeed 0.19.8's at 2 ranks: the model of
tests/test_deepspeed_moe_ep.py with the same weights, trained on the same micro-batches by DeepSpeed's loop
(`engine(x, y)`, `engine.backward`, `engine.step`) in both engines."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import paratrain as deepspeed
from tests.cases import STABLE_EPS, import_deepspeed
from tests.test_deepspeed_moe_ep import (
    EXPERTS,
    MICRO_BATCH,
    STEPS,
    VARIANTS,
    D,
    make_model,
    moe_param_groups,
    token_windows,
)

# Real DeepSpeed: top-1 dropping is left out (without random token selection DeepSpeed keeps a torch top-k of
# tied scores, whose order torch leaves open); no gradient clipping (DeepSpeed clips expert and dense norms its
# own way, which is not what this compares).
DEEPSPEED_VARIANTS = ("top1 dropless", "top2 dropping", "top2 dropless")
ADAMW = {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": STABLE_EPS}


def _deepspeed_copy(variant: str, rank: int) -> nn.Module:
    """DeepSpeed's own MoE model with `make_model(variant)`'s weights; its local experts are [2r, 2r + 2)."""
    import deepspeed as real

    ours = make_model(variant)
    model = make_model(variant)
    for i, moe in enumerate(ours.moes):
        model.moes[i] = real.moe.layer.MoE(D, nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)),
                                           num_experts=EXPERTS, ep_size=2, capacity_factor=1.0, min_capacity=1,
                                           use_rts=False, top2_2nd_expert_sampling=False, **VARIANTS[variant])
        with torch.no_grad():
            model.moes[i].deepspeed_moe.gate.wg.weight.copy_(moe.deepspeed_moe.gate.wg.weight)
            stacked = moe.deepspeed_moe.experts
            for local, expert in enumerate(model.moes[i].deepspeed_moe.experts.deepspeed_experts):
                for j, index in enumerate((0, 2)):  # the Sequential's two Linears
                    expert[index].weight.copy_(stacked.weights[j][2 * rank + local])
                    expert[index].bias.copy_(stacked.biases[j][2 * rank + local])
    return model


def _train_by_hand(engine, rank: int) -> list[float]:
    """3 steps of DeepSpeed's loop on this rank's micro-batches (the same for both engines): local losses."""
    data, losses = token_windows(), []
    for step in range(STEPS):
        idx, targets = zip(*(data[(step * 2 + rank) * MICRO_BATCH + i] for i in range(MICRO_BATCH)))
        loss = engine(torch.stack(idx), torch.stack(targets))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _ours_and_deepspeeds() -> dict:
    import logging
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed as real

    real.utils.logger.setLevel(logging.WARNING)
    rank, out = dist.get_rank(), {}
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0}
    for variant in DEEPSPEED_VARIANTS:
        mine = make_model(variant)
        ours, *_ = deepspeed.initialize(model=mine, model_parameters=moe_param_groups(mine),
                                        config={**config, "optimizer": {"type": "AdamW", "params": ADAMW}})
        model = _deepspeed_copy(variant, rank)
        theirs, *_ = real.initialize(model=model, model_parameters=real.moe.utils
                                     .split_params_into_different_moe_groups_for_optimizer(
                                         {"params": list(model.parameters()), "name": "parameters"}),
                                     config={**config, "steps_per_print": 10**9, "zero_optimization": {"stage": 0},
                                             "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}}},
                                     dist_init_required=False)
        out[variant] = (_train_by_hand(ours, rank), _train_by_hand(theirs, rank))
    return out


def test_losses_equal_real_deepspeed_ep2(world2):
    """The same model and data in real DeepSpeed 0.19.8 with ep_size=2 and in paratrain, 2 ranks: every rank's
    loss of every step within 1e-5 relative."""
    import_deepspeed()
    worst = 0.0
    per_rank = world2.run(_ours_and_deepspeeds)
    for variant, (ours, _) in per_rank[0].items():
        assert len(set(ours)) == STEPS, (variant, ours)  # the model trains: every step's loss differs
    for rank, per_variant in enumerate(per_rank):
        for variant, (ours, theirs) in per_variant.items():
            errors = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
            assert max(errors) <= 1e-5, (rank, variant, ours, theirs)
            worst = max(worst, *errors)
    print(f"paratrain vs DeepSpeed ep2: worst loss error {worst:.1e}; rank 0: {per_rank[0]}")

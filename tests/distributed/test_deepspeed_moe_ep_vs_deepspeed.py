"""paratrain's `deepspeed.moe.layer.MoE(ep_size=2)` against real DeepSpeed 0.19.8's at 2 ranks: the model of
tests/distributed/test_deepspeed_moe_ep.py with the same weights, trained on the same micro-batches by DeepSpeed's loop
(`engine(x, y)`, `engine.backward`, `engine.step`) in both engines."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import paratrain as deepspeed
from tests.cases import STABLE_EPS, import_deepspeed
from tests.distributed.test_deepspeed_moe_ep import (
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
LOSS_REL = 2e-7  # what docs/moe.md states: at most a float32 rounding or two apart
ADAMW_SECTION = {"type": "AdamW", "params": ADAMW}
# Adam's update ignores a uniform scale of a gradient; SGD's does not, so a wrong expert divisor shows there
SGD_SECTION = {"type": "SGD", "params": {"lr": 0.5}}
DEEPSPEEDS = {"AdamW": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}}, "SGD": SGD_SECTION}


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


def _doubled_expert_gradients(engine) -> None:
    """The broken variant the comparison must catch: expert gradients divided by the expert-data-parallel size
    (1 here) instead of dp (2), i.e. twice too large (on the engine's own expert parameters: expert parallelism
    replaced the model's)."""
    from paratrain.moe.utils import is_moe_param

    experts = [p for p in engine.module.parameters() if is_moe_param(p)]
    assert experts
    for p in experts:
        p.register_hook(lambda g: g * 2)


def _ours_and_deepspeeds() -> dict:
    import logging
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed as real

    real.utils.logger.setLevel(logging.WARNING)
    rank, out = dist.get_rank(), {}
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0}
    for variant, optimizer in [(v, ADAMW_SECTION) for v in DEEPSPEED_VARIANTS] + [("top2 dropless", SGD_SECTION)]:
        runs = []
        for broken in (False, True):
            mine = make_model(variant)
            ours, *_ = deepspeed.initialize(model=mine, model_parameters=moe_param_groups(mine),
                                            config={**config, "optimizer": optimizer})
            if broken:
                _doubled_expert_gradients(ours)
            runs.append(_train_by_hand(ours, rank))
        model = _deepspeed_copy(variant, rank)
        theirs, *_ = real.initialize(model=model, model_parameters=real.moe.utils
                                     .split_params_into_different_moe_groups_for_optimizer(
                                         {"params": list(model.parameters()), "name": "parameters"}),
                                     config={**config, "steps_per_print": 10**9, "zero_optimization": {"stage": 0},
                                             "optimizer": DEEPSPEEDS[optimizer["type"]]},
                                     dist_init_required=False)
        out[f"{variant} {optimizer['type']}"] = (runs[0], _train_by_hand(theirs, rank), runs[1])
    return out


def test_losses_equal_real_deepspeed_ep2(world2):
    """The same model and data in real DeepSpeed 0.19.8 with ep_size=2 and in paratrain, 2 ranks: every rank's
    loss of every step is DeepSpeed's within LOSS_REL, under AdamW and SGD; doubling the expert gradients (a wrong
    divisor, applied in the test) changes SGD's losses after the first update, so the comparison sees the
    experts' divisor (Adam's update ignores a uniform scale, so there it cannot)."""
    import_deepspeed()
    per_rank = world2.run(_ours_and_deepspeeds)
    for variant, (ours, _, _) in per_rank[0].items():
        assert len(set(ours)) == STEPS, (variant, ours)  # the model trains: every step's loss differs
    for rank, per_variant in enumerate(per_rank):
        for variant, (ours, theirs, broken) in per_variant.items():
            worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
            assert worst <= LOSS_REL, (rank, variant, worst, ours, theirs)
            print(f"rank {rank} {variant}: worst relative loss difference {worst:.1e}")
            if variant.endswith("SGD"):
                assert broken[0] == theirs[0] and broken[1:] != theirs[1:], (rank, variant, broken, theirs)

"""An objective's reference model in the plan (`paratrain plan --objective dpo`, or a config's `objective` section).

DPO (and GRPO with beta > 0) reads reference log-probs. Where they come from is the engine's rule
(`engine/objective_step.ObjectiveStep.reference_mode`, asked here, not copied):
  "initial"       a frozen copy of the initial weights (or of `objective.reference_model`), parallelized on the
                  policy's mesh like a frozen weight: whole in the compute dtype at ZeRO 0-2, one shard of each
                  ZeRO-3 unit's padded buffer at stage 3 (the routed experts over edp), split by tp, partitioned by
                  the pipeline. `engine.memory_stats()` counts it in params and alone in `reference_params`;
                  `memory.reference_bytes` is that number.
  "adapters_off"  the policy with its adapters switched off: no second copy.
  "batch"         log-probs the batch carries (precomputed): no copy, no forward.
The reference's forward (initial and adapters_off) runs under no_grad before the policy's forward of each
micro-batch: it keeps no activations, and at its peak holds one layer's activations and, on the head's stage,
the logits, never while the policy's full-recompute backward or loss hold theirs: the transient memory counts one
layer's activations under every recompute policy (`memory.transient_bytes`). Its FLOPs, a forward (2 per
parameter and token, and a third of the attention's), are added to the stage's compute; its collectives
(tensor-parallel sums, ZeRO-3 gathers of the copy, cp exchanges) are not modeled.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from paratrain.config.objective import ObjectiveConfig
from paratrain.errors import Error
from paratrain.planner.model_shape import ModelShape, PlannerError, ReferencePlan


def resolve_reference(section: dict, has_adapters: bool, source: str) -> ReferencePlan | None:
    """The objective section (`source` names where it came from, for errors) resolved as the engine resolves it;
    None for next-token cross-entropy."""
    # the engine's rule, imported here only: the planner's formulas (step_time imports this module) need no engine
    from paratrain.engine.objective_step import ObjectiveStep
    from paratrain.objectives import build_objective

    try:
        settings = ObjectiveConfig.model_validate(section)
        if settings.type == "sft":
            if settings.reference is not None or settings.reference_model is not None:
                raise PlannerError(f"{source}: a reference belongs to the dpo and grpo objectives; add --objective "
                                   f"dpo (or grpo with --beta > 0), or leave the reference out")
            return None
        mode = ObjectiveStep.reference_mode(build_objective(settings), settings.reference, has_adapters,
                                            settings.reference_model)
    except ValidationError as exc:
        raise PlannerError(f"{source}: {exc.errors()[0]['msg']}") from None
    except Error as exc:
        raise PlannerError(f"{source}: {exc}") from None
    if mode == "initial" and has_adapters:
        raise PlannerError(f"{source}: a frozen initial copy of a model with adapters is not costed by the planner; "
                           f"with --lora-r the reference is the model with its adapters off (objective.reference "
                           f"\"adapters_off\", the default) or precomputed (\"batch\")")
    return ReferencePlan(dict(section), mode)


def config_objective(model: str) -> dict | None:
    """The objective section of a config file given as --model (None for a preset or a config without one)."""
    path = Path(model)
    if not path.is_file():
        return None
    section = json.loads(path.read_text()).get("objective")
    return dict(section) if isinstance(section, dict) else None


def reference_forward_flops_per_token(shape: ModelShape, dense: int, moe: int, first: bool, head: bool) -> float:
    """FLOPs per token of the reference's forward over a stage's `dense` and `moe` blocks (with the embedding on
    the `first` stage and the head on the `head` stage): 2 per parameter (a MoE block's active ones) and a third
    of the attention's forward-and-backward FLOPs."""
    attention = shape.attention_flops_per_token_per_layer() / 3
    total = dense * (2 * shape.layer_params() + attention)
    if moe:
        total += moe * (2 * shape.active_moe_block_params() + attention)
    return total + 2 * ((shape.embed_params() if first else 0) + (shape.head_params() if head else 0))

"""Training objectives on one seam: a function of the micro-batch and its exact per-target log-probs returning a
sum and the count it is divided by (docs/objectives.md)."""

from paratrain.config.objective import ObjectiveConfig
from paratrain.objectives.base import NextToken, Objective, Value
from paratrain.objectives.dpo import DPO
from paratrain.objectives.grpo import GRPO
from paratrain.objectives.log_probs import LogProbs

__all__ = ["DPO", "GRPO", "LogProbs", "NextToken", "Objective", "Value", "build_objective"]


def build_objective(settings: ObjectiveConfig) -> Objective:
    """The objective the `objective` section names."""
    return {"sft": lambda s: NextToken(), "dpo": DPO, "grpo": GRPO}[settings.type](settings)

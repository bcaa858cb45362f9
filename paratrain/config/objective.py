"""The `objective` section: what a step trains on, with TRL 1.16's names and defaults (docs/objectives.md).

    "objective": {"type": "dpo", "beta": 0.1, "loss_type": "sigmoid"}
    "objective": {"type": "grpo", "loss_type": "dapo", "epsilon": 0.2, "beta": 0.0}

Absent (or {"type": "sft"}): next-token cross-entropy over the target tokens, as always. Every objective is
normalised by a global count (tokens, sequences or pairs of the optimizer step's whole batch), so no layout,
accumulation or sequence split changes it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from paratrain.config.section import Section
from paratrain.errors import InvalidValueError

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "bco_pair", "nca_pair", "sppo_hard", "apo_zero", "apo_down",
                  "sigmoid_norm", "exo_pair")
GRPO_LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
ROLLOUT_FIELDS = ("num_generations", "top_p", "top_k", "num_iterations", "scale_rewards", "steps_per_generation",
                  "generation_batch_size")


class ObjectiveConfig(Section):
    type: Literal["sft", "dpo", "grpo"] = "sft"
    """"sft": next-token cross-entropy; "dpo": Direct Preference Optimization and its family on preference pairs;
    "grpo": GRPO's clipped policy loss on given completions and advantages."""
    beta: float | None = None
    """DPO: the temperature of the implicit reward (TRL's default 0.1; must be > 0). GRPO: the KL coefficient
    (TRL's default 0.0: no reference model)."""
    loss_type: list[str] | str | None = None
    """DPO: one of TRL's loss types, or several (their per-pair losses added with `loss_weights`); default
    "sigmoid". GRPO: "dapo" (default), "grpo", "dr_grpo", "bnpo"."""
    loss_weights: list[float] | None = None
    """DPO with several loss types: the weight of each (TRL's `loss_weights`); default 1 each."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """DPO's robust / exo_pair: the assumed probability that a preference label is flipped."""
    reference: Literal["adapters_off", "initial", "batch"] | None = None
    """Where the reference log-probs come from (DPO; GRPO with beta > 0): "adapters_off" the model with its
    adapters switched off (no second copy), "initial" a frozen copy of the initial weights placed like the model,
    "batch" the micro-batch carries them (precomputed: ref_chosen_logps / ref_rejected_logps,
    ref_per_token_logps); unset: the batch's when it carries them, else the adapters off when the model has
    adapters, else the initial copy."""
    reference_model: str | None = None
    """A model directory (Hugging Face safetensors, or a paratrain checkpoint) whose weights the frozen reference
    takes instead of the initial model's: the same architecture as the policy, placed like it (TRL's
    `ref_model`)."""
    epsilon: float = Field(0.2, gt=0.0)
    """GRPO: the lower clipping bound of the ratio, 1 - epsilon."""
    epsilon_high: float | None = Field(None, gt=0.0)
    """GRPO: the upper clipping bound 1 + epsilon_high (DAPO's clip-higher); default epsilon."""
    delta: float | None = Field(None, gt=1.0)
    """GRPO: two-sided clipping, the ratio capped at delta (TRL's `delta`); None: off."""
    max_completion_length: int = Field(256, ge=1)
    """GRPO's dr_grpo: its normaliser is sequences x max_completion_length (TRL's)."""
    use_bias_correction_kl: bool = True
    """GRPO with beta > 0: the k3 KL times the importance ratio (TRL's default)."""
    temperature: float = Field(1.0, gt=0.0)
    """GRPO: the logits are divided by it before the log-probs, as the sampler did (TRL's `temperature`)."""
    num_generations: int = Field(8, ge=2)
    """GRPO job: completions sampled per prompt, one group (TRL's `num_generations`)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """GRPO job: nucleus sampling of the rollouts (TRL's `top_p`)."""
    top_k: int | None = Field(None, ge=1)
    """GRPO job: sample among the k likeliest tokens; None: all (TRL's `top_k`)."""
    num_iterations: int = Field(1, ge=1)
    """GRPO job: passes over each rollout batch, μ (TRL's `num_iterations`); a pass makes one optimizer step per
    optimizer step's prompts in the batch (one, unless steps_per_generation says more)."""
    generation_batch_size: int | None = Field(None, ge=1)
    """GRPO job: completions each rollout batch samples over all ranks (TRL's `generation_batch_size`); None: one
    optimizer step's, train_batch_size. k x train_batch_size samples k optimizer steps' prompts at once and trains
    them as k steps in order (TRL shuffles them first), each of the num_iterations passes going over all k. The same
    in every layout (steps_per_generation is not: it counts micro-batches of a rank)."""
    steps_per_generation: int | None = Field(None, ge=1)
    """GRPO job: micro-batches each rollout batch feeds on a rank (TRL's `steps_per_generation`): k x
    gradient_accumulation_steps is generation_batch_size = k x train_batch_size; the other of the two, or neither."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO job: the advantage's divisor, the group's reward std, the batch's, or none (TRL's `scale_rewards`)."""

    @model_validator(mode="after")
    def _known(self) -> ObjectiveConfig:
        kinds = self.loss_types
        allowed = DPO_LOSS_TYPES if self.type == "dpo" else GRPO_LOSS_TYPES if self.type == "grpo" else ()
        # set to something other than its default (a resolved config.json carries every field at its default)
        online = [name for name in ROLLOUT_FIELDS if name in self.model_fields_set
                  and getattr(self, name) != type(self).model_fields[name].default]
        if online and self.type != "grpo":
            raise InvalidValueError(f"objective.{online[0]} sets how a grpo job samples its rollouts, but "
                                    f"objective.type is \"{self.type}\"; remove it, or set objective.type to \"grpo\"")
        if self.type == "sft":
            if self.loss_type is not None or self.beta is not None:
                raise InvalidValueError("objective.loss_type and objective.beta belong to the dpo and grpo "
                                        "objectives; set objective.type, or remove them")
            return self
        unknown = [k for k in kinds if k not in allowed]
        if unknown:
            raise InvalidValueError(f"objective.loss_type {unknown[0]!r} is not a {self.type} loss type TRL has "
                                    f"that paratrain builds; choose from {list(allowed)}")
        if self.type == "grpo" and len(kinds) != 1:
            raise InvalidValueError(f"objective.loss_type: grpo takes one loss type, got {kinds}")
        if self.loss_weights is not None and len(self.loss_weights) != len(kinds):
            raise InvalidValueError(f"objective.loss_weights has {len(self.loss_weights)} weights for "
                                    f"{len(kinds)} loss types {kinds}: give one weight per loss type")
        if self.type == "dpo" and self.effective_beta <= 0:
            raise InvalidValueError(f"objective.beta must be > 0 for dpo (the implicit reward's temperature), got "
                                    f"{self.beta}; TRL's default is 0.1")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise InvalidValueError("objective.generation_batch_size and objective.steps_per_generation both size the "
                                    "rollout batch (as in TRL, one or the other): keep generation_batch_size, the same "
                                    "in every layout")
        if self.type == "grpo" and self.effective_beta < 0:
            raise InvalidValueError(f"objective.beta (the KL coefficient) must be >= 0, got {self.beta}")
        return self

    @property
    def loss_types(self) -> list[str]:
        if self.loss_type is None:
            return ["sigmoid"] if self.type == "dpo" else ["dapo"] if self.type == "grpo" else []
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def effective_beta(self) -> float:
        if self.beta is not None:
            return self.beta
        return 0.1 if self.type == "dpo" else 0.0

    @property
    def weights(self) -> list[float]:
        return list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_types)

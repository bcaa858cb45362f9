"""GRPO's clipped policy loss on given completions, with TRL 1.16's formulas and names
(`GRPOTrainer._compute_loss`, token-level importance sampling):

    ratio = exp(log p - log p_old)         (p_old: the rollout's, or the detached current when absent)
    l_t   = -min(ratio · A, clip(ratio, 1 - epsilon, 1 + epsilon_high) · A)  [+ beta · KL_t]
    KL_t  = exp(ref - log p) - (ref - log p) - 1     (k3; times the ratio with use_bias_correction_kl)

normalised globally, over the whole optimizer step's batch (TRL divides per micro-batch and per accumulation step):
    dapo, bnpo   sum of l_t over every completion token / the number of completion tokens
    grpo         mean over completions of (sum of l_t over its tokens / its length)
    dr_grpo      sum of l_t / (completions · max_completion_length)

`logprob_mismatch` (logged when the batch carries `old_per_token_logps`): the mean |log p - log p_old| over the
completion tokens, which is 0 up to rounding on the first update of a rollout batch when training recomputes what
the sampler computed (`engine.rollout`).
"""

from __future__ import annotations

import torch

from paratrain.config.objective import ObjectiveConfig
from paratrain.data.micro_batch import MicroBatch
from paratrain.errors import InvalidValueError
from paratrain.objectives.base import Objective, Value
from paratrain.objectives.log_probs import LogProbs

OLD, REFERENCE = "old_per_token_logps", "ref_per_token_logps"


class GRPO(Objective):
    name = "grpo"
    needs_entropy = True
    metric_names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy",
                    "logprob_mismatch")

    def __init__(self, settings: ObjectiveConfig):
        self.loss_type = settings.loss_types[0]
        self.beta = settings.effective_beta
        self.low, self.high = settings.epsilon, settings.epsilon_high if settings.epsilon_high is not None \
            else settings.epsilon
        self.delta = settings.delta
        self.max_completion_length = settings.max_completion_length
        self.bias_correction = settings.use_bias_correction_kl
        self.temperature = settings.temperature
        self.uses_reference = self.beta > 0

    def __call__(self, batch: MicroBatch, lp: LogProbs) -> Value:
        if batch.form != "completions":
            raise InvalidValueError(f"the grpo objective trains on completion micro-batches (prompt_ids, "
                                    f"completion_ids, completion_mask, advantages), got a {batch.form} micro-batch")
        logps = lp.values
        old = batch.tokens[OLD].to(logps.dtype) if OLD in batch.tokens else logps.detach()
        advantages = batch.rows["advantages"].to(logps.dtype).unsqueeze(1)  # (b, 1)
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.low, 1 + self.high)
        capped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
        per_token = -torch.min(capped * advantages, clipped * advantages)
        metrics = self._clip_metrics(lp, ratio.detach(), advantages)
        if OLD in batch.tokens:  # the sampler's log-probs against training's: 0 where the layouts are exact
            metrics["logprob_mismatch"] = (lp.token_sum((logps.detach() - old).abs()).double(), lp.token_count())
        if self.beta != 0.0:
            ref = batch.tokens[REFERENCE].to(logps.dtype)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.bias_correction:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
            metrics["kl"] = (lp.token_sum(kl.detach()).double(), lp.token_count())
        if lp.entropy is not None:
            metrics["entropy"] = (lp.token_sum(lp.entropy).double(), lp.token_count())
        loss, count = self._normalised(per_token, lp)
        return Value(loss, count, metrics)

    def _normalised(self, per_token: torch.Tensor, lp: LogProbs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loss_type in ("dapo", "bnpo"):
            return lp.token_sum(per_token), lp.token_count()
        lengths = lp.row_count()
        rows = (lengths > 0).double().sum()  # a row without a completion token (evaluation's padding) counts not
        if self.loss_type == "dr_grpo":
            return lp.token_sum(per_token), lp.once(rows * self.max_completion_length)
        per_row = lp.row_sum(per_token) / lengths.to(per_token.dtype).clamp(min=1.0)  # "grpo"
        return lp.once(per_row.sum()), lp.once(rows)

    def _clip_metrics(self, lp: LogProbs, ratio, advantages) -> dict:
        """TRL's clip_ratio/*: the share of completion tokens whose ratio the clip holds (low, high, either)."""
        low = (ratio < 1 - self.low) & (advantages < 0)
        high = (ratio > 1 + self.high) & (advantages > 0)
        count = lp.token_count()
        return {"clip_ratio/low_mean": (lp.token_sum(low.double()), count),
                "clip_ratio/high_mean": (lp.token_sum(high.double()), count),
                "clip_ratio/region_mean": (lp.token_sum((low | high).double()), count)}

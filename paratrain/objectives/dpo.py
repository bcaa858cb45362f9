"""Direct Preference Optimization and its family, with TRL 1.16's formulas and names (`DPOTrainer._compute_loss`).

A preference micro-batch holds the chosen rows, then the rejected rows of the same pairs. Sequence log-probs are
sums over each completion's tokens (`LogProbs.row_sum`: whole rows under any split); the loss is the mean over the
global batch's pairs of the weighted per-pair losses, so its unit is pairs (counted once: log_probs.py's note).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.config.objective import ObjectiveConfig
from paratrain.data.micro_batch import MicroBatch
from paratrain.errors import InvalidValueError
from paratrain.objectives.base import Objective, Value
from paratrain.objectives.log_probs import LogProbs

REFERENCE = "ref_per_token_logps"


class DPO(Objective):
    name = "dpo"
    uses_reference = True
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                    "logps/rejected")

    def __init__(self, settings: ObjectiveConfig):
        self.beta = settings.effective_beta
        self.loss_types = settings.loss_types
        self.weights = settings.weights
        self.label_smoothing = settings.label_smoothing

    def needs_reference(self, batch: MicroBatch) -> bool:
        return "ref_logps" not in batch.rows and REFERENCE not in batch.tokens

    def __call__(self, batch: MicroBatch, lp: LogProbs) -> Value:
        if batch.form != "preference":
            raise InvalidValueError(f"the dpo objective trains on preference micro-batches (input_ids, "
                                    f"attention_mask, completion_mask: chosen rows, then rejected), got a "
                                    f"{batch.form} micro-batch; feed pairs (data.format \"preference\")")
        logps = lp.row_sum()  # (2P,) chosen, then rejected
        ref = batch.rows["ref_logps"] if "ref_logps" in batch.rows else \
            lp.row_sum(batch.tokens[REFERENCE].to(lp.values.dtype))  # summed as the policy's: equal ones give 0
        ref = ref.to(logps.dtype)
        lengths = lp.row_count().to(logps.dtype)
        chosen, rejected = logps.chunk(2)
        chosen_ratio, rejected_ratio = (logps - ref).chunk(2)
        per_pair = sum(weight * self._pair_loss(kind, chosen_ratio, rejected_ratio, lengths.chunk(2))
                       for kind, weight in zip(self.loss_types, self.weights))
        # a pair counts when both completions have a token (engine.evaluate pads with pairs that have none)
        real = ((lengths[: chosen.shape[0]] > 0) & (lengths[chosen.shape[0]:] > 0)).to(logps.dtype)
        rewards_c, rewards_r = (self.beta * chosen_ratio).detach(), (self.beta * rejected_ratio).detach()
        metrics = {"rewards/chosen": rewards_c, "rewards/rejected": rewards_r,
                   "rewards/accuracies": (rewards_c > rewards_r).to(logps.dtype),
                   "rewards/margins": rewards_c - rewards_r, "logps/chosen": chosen.detach(),
                   "logps/rejected": rejected.detach()}
        counted = lp.once(real.sum().double())
        return Value(lp.once((per_pair * real).sum()), counted,
                     {name: (lp.once((value * real).sum().double()), counted) for name, value in metrics.items()})

    def _pair_loss(self, kind: str, chosen_ratio, rejected_ratio, lengths) -> torch.Tensor:
        """TRL's per-pair loss of one loss type (reverse KL scores: the log-ratios themselves)."""
        beta, eps = self.beta, self.label_smoothing
        delta = chosen_ratio - rejected_ratio
        if kind == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if kind == "hinge":
            return torch.relu(1 - beta * delta)
        if kind in ("ipo", "sigmoid_norm"):  # per-token average scores (TRL normalises both by the lengths)
            chosen_len, rejected_len = lengths
            avg = chosen_ratio / chosen_len.clamp(min=1.0) - rejected_ratio / rejected_len.clamp(min=1.0)
            return (avg - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * avg)
        if kind == "robust":
            clean = -(1 - eps) * F.logsigmoid(beta * delta)
            flipped = -eps * F.logsigmoid(-beta * delta)
            return (clean - flipped) / (1 - 2 * eps)
        if kind == "exo_pair":
            eps_t = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
            qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
            return qw * (F.logsigmoid(beta * delta) - torch.log1p(-eps_t)) + \
                ql * (F.logsigmoid(-beta * delta) - torch.log(eps_t))
        chosen_r, rejected_r = beta * chosen_ratio, beta * rejected_ratio
        if kind == "nca_pair":
            return -F.logsigmoid(chosen_r) - 0.5 * F.logsigmoid(-chosen_r) - 0.5 * F.logsigmoid(-rejected_r)
        if kind == "bco_pair":
            return -F.logsigmoid(chosen_r) - F.logsigmoid(-rejected_r)
        if kind == "sppo_hard":
            return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        if kind == "apo_zero":
            return 1 - torch.sigmoid(chosen_r) + torch.sigmoid(rejected_r)
        if kind == "apo_down":
            return torch.sigmoid(chosen_r) + 1 - torch.sigmoid(beta * delta)
        raise InvalidValueError(f"objective.loss_type {kind!r} is not a dpo loss type")

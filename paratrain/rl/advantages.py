"""Group-relative advantages from the global batch's rewards, TRL 1.16's way (`GRPOTrainer`, its default
`multi_objective_aggregation="sum_then_normalize"`):

    reward_i    = sum over functions of weight_f * reward_{i,f}  (None / NaN terms skipped; NaN if every one is)
    advantage_i = (reward_i - mean of its group) / (std + 1e-4)
        scale_rewards "group": std of its group; "batch": std of the whole batch; "none": not divided

over groups of `num_generations` consecutive rows (the completions of one prompt), the means and stds skipping NaN
rewards and the std with Bessel's correction; a row no function scored gets advantage 0. The rewards are the global
batch's (`RewardFunctions.score` gathers them), so the advantages do not depend on how rows were dealt to ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.errors import InvalidValueError

SCALES = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation over non-NaN values with Bessel's correction (NaN with fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=dim is not None)
    count = count if dim is not None else count.reshape(())
    corrected = variance * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.nan)
    return corrected.sqrt().squeeze(dim) if dim is not None else corrected.sqrt()


@dataclass
class Advantages:
    advantages: torch.Tensor  # (rows,) one per completion, global batch order
    rewards: torch.Tensor  # (rows,) the weighted sums (NaN: unscored)
    metrics: dict[str, float]  # TRL's names: reward, reward_std, frac_reward_zero_std, rewards/<name>/mean, .../std


def group_advantages(rewards_per_function: torch.Tensor, weights: torch.Tensor, names: list[str],
                     num_generations: int, scale_rewards: str = "group") -> Advantages:
    """`rewards_per_function`: (rows, functions), rows in groups of `num_generations` consecutive completions."""
    if scale_rewards not in SCALES:
        raise InvalidValueError(f"objective.scale_rewards is {scale_rewards!r}; choose one of {list(SCALES)}")
    rows = rewards_per_function.shape[0]
    if num_generations < 1 or rows % num_generations:
        raise InvalidValueError(f"objective.num_generations ({num_generations}) must divide the rollout batch "
                                f"({rows} completions): every prompt's completions form one group")
    per_function = rewards_per_function.float()
    unscored = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.float()[None]).nansum(dim=1)
    rewards[unscored] = torch.nan
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rows > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations) if num_generations > 1 \
            else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
               "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).float().mean())}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(per_function[:, i]))
        metrics[f"rewards/{name}/std"] = float(nanstd(per_function[:, i]))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, metrics)

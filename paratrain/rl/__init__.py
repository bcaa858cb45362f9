"""Online RL's pieces beside the objective: reward functions with TRL's signature (`rewards.py`) and group-relative
advantages from the global batch's rewards (`advantages.py`); rollouts are `engine.rollout` (docs/objectives.md)."""

from paratrain.rl.advantages import Advantages, group_advantages
from paratrain.rl.rewards import RewardError, RewardFunctions, load_reward_function

__all__ = ["Advantages", "RewardError", "RewardFunctions", "group_advantages", "load_reward_function"]

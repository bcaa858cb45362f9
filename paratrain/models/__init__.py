"""Reference models used by the examples, tests and the planner."""

from paratrain.models.gpt import GPT, PRESETS, Block, CausalSelfAttention, GPTConfig, gpt_config

__all__ = ["GPT", "PRESETS", "Block", "CausalSelfAttention", "GPTConfig", "gpt_config"]

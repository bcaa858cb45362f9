"""Reference model families, each with its model spec (how the strategies apply to it)."""

from paratrain.models.gpt import GPT, PRESETS, Block, CausalSelfAttention, GPTConfig, gpt_config
from paratrain.models.gpt_spec import GPT_PLAN, GPTSpec, gpt_pipeline_module

__all__ = ["GPT", "GPT_PLAN", "GPTSpec", "PRESETS", "Block", "CausalSelfAttention", "GPTConfig", "gpt_config",
           "gpt_pipeline_module"]

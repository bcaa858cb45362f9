"""Reference model families, each with its model spec (how the strategies apply to it)."""

from paratrain.models.gpt import GPT, PRESETS, Block, CausalSelfAttention, GPTConfig, gpt_config
from paratrain.models.gpt_spec import GPT_PLAN, GPTSpec, gpt_pipeline_module
from paratrain.models.hf import HFCausalLM
from paratrain.models.hf_spec import HFSpec
from paratrain.models.llama import PRESETS as LLAMA_PRESETS
from paratrain.models.llama import Llama, LlamaConfig, llama_config
from paratrain.models.llama_moe import PRESETS as LLAMA_MOE_PRESETS
from paratrain.models.llama_moe import LlamaMoE, LlamaMoEConfig, llama_moe_config
from paratrain.models.llama_moe_spec import LlamaMoESpec
from paratrain.models.llama_spec import LLAMA_PLAN, LlamaSpec, llama_pipeline_module
from paratrain.models.registry import build_model, preset_config

__all__ = ["GPT", "GPT_PLAN", "GPTSpec", "LLAMA_PLAN", "LLAMA_PRESETS", "PRESETS", "Block", "CausalSelfAttention",
           "GPTConfig", "HFCausalLM", "HFSpec",
           "LLAMA_MOE_PRESETS", "Llama", "LlamaConfig", "LlamaMoE", "LlamaMoEConfig", "LlamaMoESpec", "LlamaSpec",
           "build_model", "gpt_config", "gpt_pipeline_module",
           "llama_config", "llama_moe_config", "llama_pipeline_module", "preset_config"]

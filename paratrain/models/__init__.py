"""Reference model families, each with its model spec (how the strategies apply to it)."""

from paratrain.models.gpt.model import GPT, PRESETS, Block, CausalSelfAttention, GPTConfig, gpt_config
from paratrain.models.gpt.spec import GPT_PLAN, GPTSpec, gpt_pipeline_module
from paratrain.models.hf.model import HFCausalLM
from paratrain.models.hf.spec import HFSpec
from paratrain.models.llama.model import PRESETS as LLAMA_PRESETS
from paratrain.models.llama.model import Llama, LlamaConfig, llama_config
from paratrain.models.llama.spec import LLAMA_PLAN, LlamaSpec, llama_pipeline_module
from paratrain.models.llama_moe.model import PRESETS as LLAMA_MOE_PRESETS
from paratrain.models.llama_moe.model import LlamaMoE, LlamaMoEConfig, llama_moe_config
from paratrain.models.llama_moe.spec import LlamaMoESpec
from paratrain.models.registry import build_model, preset_config

__all__ = ["GPT", "GPT_PLAN", "GPTSpec", "LLAMA_PLAN", "LLAMA_PRESETS", "PRESETS", "Block", "CausalSelfAttention",
           "GPTConfig", "HFCausalLM", "HFSpec",
           "LLAMA_MOE_PRESETS", "Llama", "LlamaConfig", "LlamaMoE", "LlamaMoEConfig", "LlamaMoESpec", "LlamaSpec",
           "build_model", "gpt_config", "gpt_pipeline_module",
           "llama_config", "llama_moe_config", "llama_pipeline_module", "preset_config"]

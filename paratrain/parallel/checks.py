"""What `parallelize` checks before anything changes or communicates: the layout against this build
(`check_supported`, once, from the settings alone) and against the model (`check_model`). Every rank raises the
same error, naming the field and the fix."""

from __future__ import annotations

from torch import nn

from paratrain.adapters.quantized import check_4bit_dequantization
from paratrain.config.errors import ConfigError
from paratrain.model_spec import ModelSpec, spec_for
from paratrain.moe.layer import expert_parallel_size_of
from paratrain.parallel.cp import check_context_parallel
from paratrain.parallel.cp.ulysses import check_heads
from paratrain.parallel.ep.split import check_expert_parallel
from paratrain.parallel.pp.module import PipelineModule
from paratrain.parallel.pp.schedules import ScheduleError, check_sizes
from paratrain.parallel.settings import Strategies
from paratrain.parallel.tp.plan import check_plan_syntax


def check_supported(strategies: Strategies) -> None:
    """Raise, before any collective, for layouts this build cannot run (once, in `resolve_config`)."""
    check_plan_syntax(strategies.tensor.section.plan)  # a PlanError is a ConfigError
    pp, micro_batches, zero = strategies.pipeline.section, strategies.pipeline.micro_batches, strategies.data.zero
    if pp.stages > 1 and micro_batches is not None:
        try:
            check_sizes(pp.schedule, pp.stages, micro_batches, pp.virtual_stages)
        except ScheduleError as exc:
            raise ConfigError(f"config section 'pipeline': {exc}") from None
    if pp.stages > 1 and zero.stage == 3:
        raise ConfigError("zero_optimization.stage 3 with pipeline.stages > 1 is not supported: every micro-batch "
                          "would all-gather each unit's parameters again in its forward and its backward (2m "
                          "gathers of the stage per step), which costs more than the pipeline saves, and stage 3 "
                          "gathers its root unit in the model's forward, which a pipeline stage never calls; a "
                          "stage already holds only its share of the model (DeepSpeed refuses the pair too). Use "
                          "zero_optimization.stage 1 or 2, or more pipeline stages")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("config key 'zero_optimization.offload_optimizer.device' = \"cpu\" needs sharded "
                          "optimizer states; set zero_optimization.stage to 1, 2 or 3")
    if zero.offload_param.device != "none":
        if zero.stage != 3:
            raise ConfigError(f"config key 'zero_optimization.offload_param.device' = \"cpu\" needs sharded "
                              f"parameters; set zero_optimization.stage to 3 (it is {zero.stage})")
        if zero.offload_optimizer.device == "none":
            raise ConfigError("config key 'zero_optimization.offload_param.device' = \"cpu\": the parameter "
                              "shard is the fp32 master the optimizer updates, so it can only live on the host "
                              "with the optimizer; also set zero_optimization.offload_optimizer.device to \"cpu\"")


def check_experts(model: nn.Module, ep: int, spec: ModelSpec) -> None:
    """The expert-parallel size `ep` against the model's MoE layers (DeepSpeed's carry their own ep_size)."""
    layers_ep = expert_parallel_size_of(model, ep)  # refuses layers that disagree with each other or the config
    if layers_ep != ep:  # an engine built without initialize(), which adopts the layers' size
        raise ConfigError(f"config key 'expert_parallel.size' = {ep} but the model's deepspeed.moe.layer.MoE "
                          f"layers have ep_size={layers_ep}: set expert_parallel.size to {layers_ep}, or build "
                          f"the engine with paratrain.initialize (it takes the layers' ep_size)")
    if ep > 1:
        check_expert_parallel(spec.expert_layers(model), ep)


def check_model(model: nn.Module, strategies: Strategies, spec: ModelSpec | None = None) -> None:
    """Checks that need the model, before anything changes or communicates."""
    spec = spec or spec_for(model)
    cpc, tp = strategies.context, strategies.tensor.section
    cp, ep = cpc.size, strategies.expert_parallel_size
    seq_len = spec.sequence_length(model)
    spec.check(model, {"tp": tp.size, "pp": strategies.pipeline.section.stages, "cp": cp,
                       "sp": int(tp.sequence_parallel and tp.size > 1), "ep": ep})
    check_context_parallel(model, cp)
    check_experts(model, ep, spec)
    check_4bit_dequantization(model)
    heads = getattr(getattr(model, "config", None), "n_head", None)
    if cp > 1 and cpc.method != "ring" and isinstance(heads, int) and heads % tp.size == 0:
        try:  # Ulysses splits each tp rank's heads again
            check_heads(heads // tp.size, cpc.size if cpc.method == "ulysses" else cpc.ulysses_size)
        except ValueError as exc:
            raise ConfigError(f"context_parallel.method {cpc.method!r}: {exc}") from None
    ac = strategies.recompute
    if ac.enabled and not isinstance(model, PipelineModule):  # a PipelineModule's layers are its blocks
        if ac.granularity == "full" and not spec.blocks(model):
            raise ConfigError(f"activation_checkpointing.granularity \"full\" recomputes each transformer block, "
                              f"the children of an nn.ModuleList, and {type(model).__name__} has none: keep the "
                              f"blocks in an nn.ModuleList, or write the model as a paratrain.PipelineModule")
        if ac.granularity == "selective" and not spec.attention_cores(model):
            raise ConfigError(f"activation_checkpointing.granularity \"selective\" recomputes the attention cores "
                              f"(paratrain.attention.CausalAttentionCore modules) and {type(model).__name__} has "
                              f"none: build the attention with one, or use granularity \"full\"")
    if cp > 1 and tp.size > 1 and tp.sequence_parallel and seq_len is not None and seq_len % (cp * tp.size):
        raise ConfigError(f"context_parallel.size ({cp}) with tensor_parallel.sequence_parallel: each cp rank's "
                          f"{seq_len // cp} tokens are split again over tensor_parallel.size ({tp.size}); use a "
                          f"sequence length (model seq_len {seq_len}) divisible by {cp * tp.size}")

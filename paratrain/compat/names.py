"""DeepSpeed names paratrain does not provide, and what to use instead.

`import paratrain as deepspeed` must never give a silent difference: a DeepSpeed attribute that paratrain
lacks raises `DeepSpeedNotSupported` naming it and the replacement, instead of a bare AttributeError or,
worse, a stand-in that changes numbers. It subclasses AttributeError so `hasattr(deepspeed, "x")` and
`getattr(..., default)` keep working. The tables are what docs/deepspeed-compat.md lists as refused.
"""

from __future__ import annotations

from paratrain.errors import Error

DOCS = "docs/deepspeed-compat.md"


class DeepSpeedNotSupported(Error, AttributeError):
    """A DeepSpeed name or call that paratrain deliberately does not implement; the message says what to use."""


# deepspeed.<name>
TOP_LEVEL = {
    "PipelineEngine": "paratrain.Engine runs pipelines itself (pipeline.stages > 1); test `engine.pipeline is not "
                      "None` instead of isinstance(engine, PipelineEngine)",
    "init_inference": "paratrain trains; it has no inference engine (use engine.module, or "
                      "engine.full_state_dict() with a plain model)",
    "InferenceEngine": "paratrain has no inference engine",
    "add_tuning_arguments": "the autotuner is not part of paratrain; `paratrain plan` ranks layouts instead",
    "ops": "DeepSpeed's fused kernels (FusedAdam, DeepSpeedCPUAdam, FusedLamb) are not part of paratrain; set the "
           "config's optimizer section (Adam/AdamW run fused on CPU and CUDA) or pass a torch.optim optimizer",
    "accelerator": "paratrain has no accelerator abstraction; use engine.device (cuda:LOCAL_RANK under NCCL, "
                   "cpu under gloo)",
    "utils": "deepspeed.utils is not provided; the logger is logging.getLogger('paratrain'), full parameters "
             "come from engine.full_state_dict()",
    "module_inject": "kernel injection is not implemented in paratrain",
    "replace_transformer_layer": "kernel injection is not implemented in paratrain",
    "revert_transformer_layer": "kernel injection is not implemented in paratrain",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not part of paratrain",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not part of paratrain",
    "compression": "DeepSpeed Compression is not implemented in paratrain",
    "profiling": "the flops profiler is not implemented; engine.timings() and wall_clock_breakdown give times",
    "runtime": "DeepSpeed's internals are not mirrored; use paratrain's public API (docs/deepspeed-compat.md)",
    "autotuning": "the autotuner is not part of paratrain; `paratrain plan` ranks layouts instead",
    "elasticity": "elastic batch sizes are not implemented; `paratrain run --max-restarts` restarts failed jobs",
    "inference": "paratrain has no inference engine",
    "sequence": "DeepSpeed-Ulysses is not implemented; paratrain's context_parallel section splits sequences",
    "linear": "DeepSpeed's LoRA/optimized linear layers are not part of paratrain",
    "DeepSpeedConfig": "use paratrain.load_config(path_or_dict) (typed, validated) or engine.config",
    "DeepSpeedOptimizer": "paratrain wraps no optimizer class; engine.optimizer is a torch.optim optimizer over "
                          "what this rank updates",
    "OnebitAdam": "1-bit optimizers are not implemented in paratrain",
    "OnebitLamb": "1-bit optimizers are not implemented in paratrain",
    "ZeroOneAdam": "1-bit optimizers are not implemented in paratrain",
    "DeepSpeedHybridEngine": "the RLHF hybrid engine is not implemented in paratrain",
    "tp_model_init": "DeepSpeed's AutoTP is not implemented; set tensor_parallel {size, plan} in the config",
    "checkpointing": "activation checkpointing is not available in this build (its recompute would also have to "
                     "replay the tensor-parallel dropout streams); remove the deepspeed.checkpointing calls",
}

# engine.<name>
ENGINE = {
    "set_gradient_accumulation_boundary": "paratrain derives the boundary from gradient_accumulation_steps; "
                                          "use engine.no_sync() for hand-made accumulation",
    "set_train_micro_batch_size": "the micro-batch size fixes the data sampler and the pipeline's buffers; "
                                  "change gradient accumulation with engine.set_train_batch_size(n) instead",
    "save_16bit_model": "use engine.full_state_dict() (complete, on every rank) and torch.save it on rank 0",
    "save_fp16_model": "use engine.full_state_dict() (complete, on every rank) and torch.save it on rank 0",
    "state_dict": "DeepSpeed's engine.state_dict() is the nn.Module one of a wrapper; use "
                  "engine.module_state_dict() (full, unsharded) or engine.save_checkpoint",
    "load_state_dict": "use engine.load_checkpoint(dir, tag), or load into the model before initialize()",
    "to": "the engine places the model at initialize() (engine.device); move the inputs, not the engine",
    "cuda": "the engine places the model at initialize() (engine.device)",
    "half": "set fp16.enabled in the config (fp32 master weights stay with the optimizer)",
    "bfloat16": "set bf16.enabled in the config (fp32 master weights stay with the optimizer)",
    "float": "precision comes from the config (fp16 / bf16 sections)",
    "timers": "use engine.timings() (seconds per phase) and wall_clock_breakdown in the config",
    "tput_timer": "the trainer reports tokens/s; engine.timings() has the per-phase times",
    "flops_profiler": "the flops profiler is not implemented",
    "is_first_stage": "compare engine.mesh.local_rank('pp') with 0",
    "is_last_stage": "compare engine.mesh.local_rank('pp') with engine.mesh.size('pp') - 1",
    "get_data_types": "the compute dtype follows fp16/bf16; master weights and optimizer state are fp32",
    "communication_data_type": "gradients are communicated in the compute dtype (fp32, bf16 or fp16)",
    "empty_partition_cache": "ZeRO-3 units are freed after their forward/backward; there is no cache to empty",
    "offload_states": "offload is static (zero_optimization.offload_optimizer / offload_param)",
    "reload_states": "offload is static (zero_optimization.offload_optimizer / offload_param)",
    "compile": "call torch.compile on the model before initialize()",
    "mpu": "paratrain has no Megatron mpu; the mesh is engine.mesh (axes dp, pp, cp, tp)",
}

# deepspeed.zero.<name>
ZERO = {
    "GatheredParameters": "use engine.full_state_dict() to read full parameters; to change them, change the model "
                          "before initialize()",
    "register_external_parameter": "parameters used outside their module are not supported at stage 3",
    "MiCS_Init": "MiCS is not implemented",
    "TiledLinear": "tiled linear layers are not implemented",
}

# deepspeed.pipe.<name>
PIPE = {
    "TiedLayerSpec": "weights tied across pipeline stages are not supported; use LayerSpec and untie them",
    "ProcessTopology": "the rank layout is paratrain.ParallelDims (pure rank math) and engine.mesh",
    "PipeDataParallelTopology": "the rank layout is paratrain.ParallelDims (pure rank math) and engine.mesh",
    "PipeModelDataParallelTopology": "the rank layout is paratrain.ParallelDims (pure rank math) and engine.mesh",
    "PipelineEngine": TOP_LEVEL["PipelineEngine"],
}

# deepspeed.moe.<name> (paratrain.moe has DeepSpeed's layer.MoE, ep_size included, and utils' param groups;
# paratrain.moe.experts is paratrain's own module of stacked experts, so DeepSpeed's deepspeed.moe.experts.Experts
# is a plain AttributeError)
MOE = {
    "sharded_moe": "DeepSpeed's gating internals are not mirrored; use deepspeed.moe.layer.MoE (its gate is "
                   "moe.deepspeed_moe.gate)",
    "mappings": "DeepSpeed's token gather/drop for expert tensor parallelism is not built (experts are not split "
                "over tp); the expert-parallel all-to-alls are inside deepspeed.moe.layer.MoE",
}

# deepspeed.comm.<name> (paratrain.comm is paratrain's counted collectives: they take a mesh Axis)
COMM = {
    name: "paratrain.comm's collectives take a mesh Axis (engine.mesh.axis('dp')) and are counted; for "
          f"DeepSpeed's deepspeed.comm.{name}(..., group=...) call torch.distributed.{name} directly"
    for name in ("all_gather", "all_gather_into_tensor", "all_to_all_single", "reduce", "reduce_scatter",
                 "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "gather", "scatter", "new_group",
                 "get_world_group", "get_global_rank", "destroy_process_group", "ReduceOp", "inference_all_reduce",
                 "monitored_barrier", "log_summary", "configure")
}
COMM["init_distributed"] = "call paratrain.init_distributed() (deepspeed.init_distributed)"


def refuse(table: dict[str, str], owner: str, name: str):
    """The error for `owner.name`: DeepSpeedNotSupported when DeepSpeed has it, a plain AttributeError otherwise."""
    if name in table:
        raise DeepSpeedNotSupported(f"{owner}.{name} is DeepSpeed API that paratrain does not support: "
                                    f"{table[name]} (see {DOCS})")
    raise AttributeError(f"{owner} has no attribute {name!r}")

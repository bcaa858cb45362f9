"""Config sections of the update itself: optimizer, scheduler, precision (fp16, bf16, autocast) and ZeRO."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from paratrain.config.section import Section
from paratrain.errors import InvalidValueError


class OptimizerConfig(Section):
    """`type` is Adam, AdamW, SGD or any torch.optim class name; `params` go to its constructor.

    `load_config` checks `params` by name and type (config/params.py)."""

    type: str = "AdamW"
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in value:
            raise InvalidValueError("'max_grad_norm' is not an optimizer parameter; set the top-level "
                                    "'gradient_clipping' key instead")
        return value


class SchedulerConfig(Section):
    """`type` is WarmupLR, WarmupDecayLR, WarmupCosineLR or a torch.optim.lr_scheduler class name.

    `params` go to its constructor; `load_config` checks them by name and type (config/params.py)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class FP16Config(Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0.0, description="0 means dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0.0)
    fp16_master_weights_and_grads: bool = False
    """DeepSpeed's fp16 master weights; only false is supported (paratrain keeps fp32 master weights)."""

    @field_validator("fp16_master_weights_and_grads")
    @classmethod
    def _fp32_masters(cls, value: bool) -> bool:
        if value:
            raise InvalidValueError("fp16 master weights and gradients are not supported: paratrain keeps the master "
                                    "weights and optimizer state in fp32; set it to false")
        return value


class BF16Config(Section):
    enabled: bool = False


class TorchAutocastConfig(Section):
    """DeepSpeed's torch_autocast: the forward runs under torch.autocast while parameters, master weights,
    gradients and their communication stay fp32 (the bf16/fp16 sections instead make the model itself
    low-precision). Needs bf16 and fp16 off."""

    enabled: bool = False
    """Run the model's forward (and a pipeline stage's, and the loss) under torch.autocast."""
    dtype: Literal["bfloat16", "torch.bfloat16"] = "bfloat16"
    """The autocast compute dtype. Only bfloat16: float16 autocast needs a gradient scaler, which the fp16
    section provides (use fp16.enabled instead)."""
    lower_precision_safe_modules: list[str] | None = None
    """DeepSpeed reduces these modules' gradients in the autocast dtype; paratrain reduces every gradient in
    fp32, so only the default (null) is accepted rather than a silently different meaning."""

    @field_validator("lower_precision_safe_modules")
    @classmethod
    def _only_default(cls, value):
        if value is not None:
            raise InvalidValueError("torch_autocast.lower_precision_safe_modules is not supported: paratrain keeps "
                                    "every "
                                    "gradient and its communication in fp32 under autocast; remove the key")
        return value


class LossConfig(Section):
    """How the losses of one optimizer step's micro-batches and ranks add up (docs/real-data.md)."""

    reduction: Literal["token", "micro_batch"] = "token"
    """"token": the sum of every target token's loss over the global batch divided by the number of target
    tokens (labels not -100), whatever the layout: one process's mean over the whole global batch (Megatron's
    per-token loss; transformers' Trainer with average_tokens_across_devices). "micro_batch": the mean of each
    micro-batch's mean over accumulation steps and data x context-parallel ranks (DeepSpeed's engine, and
    paratrain before 0.2). "token" applies where paratrain knows the loss is a mean over target tokens (its
    own families, Hugging Face models, a PipelineModule loss_fn that returns (sum, count)); a model's own loss
    is averaged as "micro_batch" (DeepSpeed-compatible), unless its forward returns (sum, count)."""


class OffloadConfig(Section):
    device: Literal["none", "cpu"] = "none"
    pin_memory: bool = False
    # DeepSpeed's buffer knobs are accepted for compatibility; the CPU path does not need them.
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)


class ZeroConfig(Section):
    stage: int = Field(0, ge=0, le=3)
    """0 = DDP, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters (FSDP)."""
    reduce_bucket_size: int = Field(500_000_000, ge=1, description="elements per gradient bucket")
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    offload_optimizer: OffloadConfig = Field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = Field(default_factory=OffloadConfig)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    mics_shard_size: int = -1
    """DeepSpeed's MiCS: ZeRO shards over groups of this many data-parallel ranks (x cp) and replicates across
    the groups, which is HSDP: it sets data_parallel.replicate to dp x cp / mics_shard_size. -1: off."""
    mics_hierarchical_params_gather: bool = False
    """DeepSpeed's two-level all-gather inside a MiCS group spanning nodes; not built (only false is accepted)."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """DeepSpeed ZeRO++'s secondary partition of the parameters (hpZ); not built: only 1 is accepted (HSDP,
    data_parallel.replicate or mics_shard_size, keeps parameter gathers inside a shard group instead)."""
    sub_group_size: int = Field(1_000_000_000, ge=1)
    """DeepSpeed steps the optimizer over groups of this many elements to bound its temporaries; accepted for
    compatibility (Hugging Face's ZeRO-3 example sets it): paratrain steps each shard's parameter group at once,
    which gives the same update."""
    # paratrain's FSDP knobs: which modules become stage-3 units, and whether to free after forward.
    reshard_after_forward: bool = True
    """Stage 3: free a unit's gathered parameters after its forward (regather for backward)."""
    wrap_module_classes: list[str] | None = None
    """Stage 3: class names of the modules that become units (default: every child of an nn.ModuleList)."""
    wrap_module_names: list[str] | None = None
    """Stage 3: glob patterns over module names that become units, e.g. ["blocks.*", "head"]."""
    prefetch_depth: int = Field(1, ge=0)
    """Stage 3: how many units ahead to start gathering while the current one computes."""
    # paratrain's overlap and memory trade-offs (docs/strategies.md says what each trades).
    overlap_param_gather: bool | None = None
    """Stages 1-2: all-gather the updated parameters behind the next forward (each bucket waited for where its
    parameters are first read) instead of at the end of the step. Unset (null) means on at stages 1-2, so a
    resolved config (a run's config.json) loads again at every stage."""
    reduce_at_boundary: bool = False
    """Stages 2-3: keep unsharded gradients across the micro-steps of an accumulation window and reduce-scatter
    once at its end (1/gradient_accumulation_steps of the traffic, + the unsharded gradients during the window)."""
    free_grad_buckets: bool = False
    """Stages 0-1: free the gradient buckets after each update and allocate each again when its first gradient
    of the next backward lands (no gradient memory during the forward; .grad is None between steps)."""
    cpu_offload: bool | None = None
    """Deprecated DeepSpeed spelling of offload_optimizer.device = "cpu" (true sets it)."""
    cpu_offload_param: bool | None = None
    """Deprecated DeepSpeed spelling of offload_param.device = "cpu" (true sets it)."""
    cpu_offload_use_pin_memory: bool | None = None
    """Deprecated DeepSpeed spelling of the offload sections' pin_memory."""

    @model_validator(mode="before")
    @classmethod
    def _deprecated_offload(cls, data: Any) -> Any:
        """DeepSpeed's old offload switches, translated the way DeepSpeed translates them."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if data.get(old):
                if new in data:
                    raise InvalidValueError(f"'{old}' is the deprecated spelling of '{new}'; give only '{new}'")
                data[new] = {"device": "cpu", "pin_memory": bool(data.get("cpu_offload_use_pin_memory"))}
        return data

    @model_validator(mode="after")
    def _options_of_their_stages(self) -> ZeroConfig:
        """An option set on a stage it does nothing at is a mistake worth saying (defaults are not checked)."""
        stages = {"overlap_param_gather": ((1, 2), "stage 3 gathers each unit before its forward anyway"),
                  "reduce_at_boundary": ((2, 3), "stages 0-1 already reduce once per accumulation window"),
                  "free_grad_buckets": ((0, 1), "stages 2-3 keep no gradient buckets between steps")}
        if self.mics_hierarchical_params_gather:
            raise InvalidValueError("zero_optimization.mics_hierarchical_params_gather is not built: paratrain gathers "
                                    "parameters over the shard group in one all-gather; set it to false")
        if self.zero_hpz_partition_size > 1:
            raise InvalidValueError(f"zero_optimization.zero_hpz_partition_size {self.zero_hpz_partition_size} (ZeRO++ "
                                    f"hpZ) is not built; shard inside a node with data_parallel.replicate or "
                                    f"zero_optimization.mics_shard_size (HSDP) instead, or set it to 1")
        for key, (valid, why) in stages.items():
            if key in self.model_fields_set and getattr(self, key) and self.stage not in valid:
                raise InvalidValueError(f"zero_optimization.{key} applies to stages {valid[0]}-{valid[1]} and stage is "
                                        f"{self.stage} ({why}); remove zero_optimization.{key} or set "
                                        f"zero_optimization.stage to {valid[0]} or {valid[1]}")
        return self

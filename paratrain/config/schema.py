"""The typed configuration: DeepSpeed's JSON keys plus paratrain's parallelism sections.

One home per field. Each section is a strict pydantic model (unknown keys are errors, see
`paratrain.config.load`). Defaults follow DeepSpeed where the key is DeepSpeed's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              use_attribute_docstrings=True)


class OptimizerConfig(Section):
    """`type` is Adam, AdamW, SGD or any torch.optim class name; `params` go to its constructor."""

    type: str = "AdamW"
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in value:
            raise ValueError("'max_grad_norm' is not an optimizer parameter; set the top-level "
                             "'gradient_clipping' key instead")
        return value


class SchedulerConfig(Section):
    """`type` is WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or a torch.optim.lr_scheduler class."""

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
            raise ValueError("fp16 master weights and gradients are not supported: paratrain keeps the master "
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
            raise ValueError("torch_autocast.lower_precision_safe_modules is not supported: paratrain keeps every "
                             "gradient and its communication in fp32 under autocast; remove the key")
        return value


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
    # paratrain's FSDP knobs: which modules become stage-3 units, and whether to free after forward.
    reshard_after_forward: bool = True
    """Stage 3: free a unit's gathered parameters after its forward (regather for backward)."""
    wrap_module_classes: list[str] | None = None
    """Stage 3: class names of the modules that become units (default: every child of an nn.ModuleList)."""
    wrap_module_names: list[str] | None = None
    """Stage 3: glob patterns over module names that become units, e.g. ["blocks.*", "head"]."""
    prefetch_depth: int = Field(1, ge=0)
    """Stage 3: how many units ahead to start gathering while the current one computes."""
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
                    raise ValueError(f"'{old}' is the deprecated spelling of '{new}'; give only '{new}'")
                data[new] = {"device": "cpu", "pin_memory": bool(data.get("cpu_offload_use_pin_memory"))}
        return data


class DataParallelConfig(Section):
    """paratrain's own DDP knobs. `size=-1` means world / (pp*cp*tp)."""

    size: int = -1
    bucket_cap_mb: float = Field(25.0, gt=0.0)
    """DDP gradient bucket size; a bucket's all-reduce starts as soon as it is full."""
    allow_unused_parameters: bool = False
    """Treat parameters that get no gradient as zero instead of raising."""
    broadcast_buffers: bool = True
    """Broadcast buffers from dp rank 0 at start (parameters always are)."""

    @field_validator("size")
    @classmethod
    def _size(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError("must be a positive integer, or -1 for 'the rest of the world'")
        return value


class TensorParallelConfig(Section):
    """Megatron-style tensor parallelism over the tp axis (see docs/strategies.md)."""

    size: int = Field(1, ge=1)
    """Ranks that split each layer's weight matrices (consecutive ranks of the mesh)."""
    sequence_parallel: bool = False
    """Norm/dropout/residual regions hold s/tp tokens; all-gathers and reduce-scatters replace the all-reduces."""
    plan: dict[str, str] | str | None = None
    """{module-path pattern: style}, or a built-in plan name ("gpt"); None uses the model's ready plan (GPT)."""


class PipelineConfig(Section):
    """Pipeline parallelism: the model's layers cut into stages over the pp axis (see docs/strategies.md)."""

    stages: int = Field(1, ge=1)
    """Pipeline ranks (p); 1 disables pipelining."""
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = "1f1b"
    """Order of forwards and backwards: gpipe, 1f1b, interleaved (virtual_stages chunks per rank), zb-h1."""
    micro_batches: int | None = Field(None, ge=1)
    """Micro-batches per optimizer step (m): the same number as gradient_accumulation_steps, which it sets."""
    virtual_stages: int = Field(1, ge=1)
    """Stages (chunks) per rank for the interleaved schedule (v)."""
    partition: Literal["uniform", "parameters", "balanced"] | list[int] = "parameters"
    """How layers are cut: uniform (count), parameters, balanced (profiled time), or boundaries [0, ..., L]."""

    @field_validator("schedule", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class ContextParallelConfig(Section):
    """Ring attention over the cp axis: each rank holds 2 mirrored chunks of every sequence."""

    size: int = Field(1, ge=1)
    """Ranks that split each sequence (the model's seq_len must be divisible by 2 x size)."""


class ActivationCheckpointingConfig(Section):
    """Recompute activations in backward instead of keeping them (in every layout; see docs/strategies.md)."""

    enabled: bool = False
    """Turn recomputation on."""
    granularity: Literal["full", "selective"] = "full"
    """full: each transformer block keeps only its input (children of an nn.ModuleList; a PipelineModule's
    layers); selective: only the attention cores are recomputed (Korthikanti et al.)."""
    # DeepSpeed's keys: DeepSpeed's engine ignores them too (only deepspeed.checkpointing.configure reads them,
    # and paratrain refuses deepspeed.checkpointing by name), so a tutorial config loads unchanged.
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class TensorboardConfig(Section):
    """TensorBoard events of every optimizer step (needs the tensorboard package: paratrain[monitor])."""

    enabled: bool = False
    output_path: str = ""
    """Directory that gets the job_name folder ("" = the working directory), as in DeepSpeed."""
    job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(Section):
    """One CSV file per metric (step,value), DeepSpeed's csv_monitor: output_path/job_name/Train_Samples_lr.csv."""

    enabled: bool = False
    output_path: str = ""
    """Directory that gets the job_name folder ("" = the working directory), as in DeepSpeed."""
    job_name: str = "DeepSpeedJobName"


class CommConfig(Section):
    """Collective time-outs: a collective that waits longer reports what it was waiting in and stops."""

    timeout_s: float = Field(600.0, gt=0.0)
    """Seconds a collective may wait before the job stops with a report (also the backend's own timeout)."""
    report_dir: str = ""
    """Where each stopped rank writes hang_report_rank{r}.json; empty: the run directory under
    `paratrain train`, else the current directory."""


class CheckpointConfig(Section):
    """Sharded checkpoints (docs/checkpoints.md): DeepSpeed's `checkpoint` keys, plus where and how often the
    engine saves by itself and whether a (re)started job resumes from the newest complete checkpoint."""

    dir: str | None = None
    """Directory the engine saves to every `save_every` steps and `auto_resume` loads from."""
    save_every: int = Field(0, ge=0)
    """Save after every N-th optimizer step (0: only when engine.save_checkpoint is called)."""
    auto_resume: bool = False
    """initialize() loads the newest complete checkpoint in `dir` when there is one (restarted jobs continue)."""
    keep_last: int = Field(0, ge=0)
    """After each save, delete all but the N newest complete checkpoints in the directory (0 keeps all)."""
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """DeepSpeed's: when ranks pass different tags to save_checkpoint, warn (and use rank 0's), fail, or ignore."""
    load_universal: bool = False
    """Accepted for DeepSpeed compatibility: every paratrain checkpoint loads under any layout."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalized(cls, value: Any) -> Any:
        return value.capitalize() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _needs_dir(self) -> CheckpointConfig:
        if self.dir is None and (self.save_every or self.auto_resume):
            raise ValueError("checkpoint.save_every / checkpoint.auto_resume need checkpoint.dir, the directory to "
                             "save to and resume from")
        return self


class TrainerConfig(Section):
    """Settings of the built-in `paratrain train` job (GPT on the embedded corpus)."""

    model: str = "gpt-tiny"
    """GPT preset (gpt-tiny, gpt-mini, gpt-small, gpt-125m, ...); `paratrain verify` also takes a user model as
    'package.module:factory', built as factory(**model_overrides)."""
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    """GPTConfig fields to replace, e.g. {"n_layer": 8}."""
    steps: int = Field(300, ge=1)
    """Optimizer steps to train."""
    eval_every: int = Field(100, ge=0)
    """Validation loss every N steps (and at the end); 0 disables."""
    eval_batches: int = Field(4, ge=1)
    run_dir: str = "runs/latest"
    """Where config.json, metrics.jsonl/.csv and summary.json go."""
    progress_bar: bool = True


class Config(Section):
    """The whole configuration. Batch keys may be partly None until `resolve_batch` fills them."""

    train_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step over all data-parallel ranks."""
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro-batches accumulated per optimizer step."""
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = Field(0.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    prescale_gradients: bool = False
    """Divide gradients by the dp size before the all-reduce instead of after."""
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    """Divide by this before the reduction and by dp/factor after it."""
    nonfinite_loss: Literal["stop", "skip"] = "stop"
    """bf16/fp32: a NaN/inf loss or gradient (seen in the global gradient norm, the same on every rank) either
    stops training with an error before the update, or skips the update on every rank (logged, counted in
    skipped_steps). fp16 always skips: its loss scaler handles overflows."""
    batch_check: Literal["shape", "dtype", "off"] = "shape"
    """train_batch/eval_batch compare every micro-batch with the first: structure, dtypes and shapes ("shape"),
    structure, dtypes and dimensions only ("dtype", for variable sequence lengths), or nothing ("off")."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = True
    """Accepted for DeepSpeed compatibility: every torch optimizer is allowed."""
    steps_per_print: int = Field(10, ge=1)
    """Log a line (and per-rank memory in the trainer) every N optimizer steps."""
    wall_clock_breakdown: bool = False
    """Log forward/backward/step/comm-wait times at each print."""
    seed: int = 1234
    """Seed of the data sampler (and of the built-in trainer's model init)."""
    data_parallel: DataParallelConfig = Field(default_factory=DataParallelConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        if self.torch_autocast.enabled and self.precision != "fp32":
            raise ValueError(f"torch_autocast.enabled with {self.precision}.enabled: autocast keeps the model in fp32 "
                             f"and casts inside the forward, {self.precision} makes the model itself "
                             f"{self.precision}; enable one of them")
        return self

    # ---- derived views ---------------------------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        return self.pipeline.stages * self.context_parallel.size * self.tensor_parallel.size

    def dp_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size if self.data_parallel.size == -1 else self.data_parallel.size

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

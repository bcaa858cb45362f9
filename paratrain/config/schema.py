"""The typed configuration: DeepSpeed's JSON keys plus paratrain's parallelism sections.

One home per field. Each section is a strict pydantic model (unknown keys are errors, see
`paratrain.config.load`). Defaults follow DeepSpeed where the key is DeepSpeed's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from paratrain.config.data import DataConfig
from paratrain.config.errors import ConfigError
from paratrain.config.fault_tolerance import FaultToleranceConfig
from paratrain.config.objective import ObjectiveConfig
from paratrain.config.outputs import (
    CheckpointConfig,
    CommConfig,
    CsvMonitorConfig,
    MlflowConfig,
    TensorboardConfig,
    TrainerConfig,
    WandbConfig,
)
from paratrain.config.parallel import (
    ActivationCheckpointingConfig,
    ContextParallelConfig,
    DataParallelConfig,
    ExpertParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
)
from paratrain.config.peft import PeftConfig
from paratrain.config.section import Section
from paratrain.config.training import (
    BF16Config,
    FP16Config,
    LossConfig,
    OptimizerConfig,
    SchedulerConfig,
    TorchAutocastConfig,
    ZeroConfig,
)
from paratrain.errors import InvalidValueError
from paratrain.layout.dims import ParallelDims


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
    nonfinite_loss: Literal["stop", "skip", "stop_at_log"] = "stop_at_log"
    """bf16/fp32: a NaN/inf loss or gradient (seen in the global gradient norm, the same on every rank).
    "stop_at_log" (the default) reads nothing per step (no host sync): the first bad step is recorded on the
    device and raised at the next steps_per_print step or checkpoint save, after its update was applied (no
    checkpoint is written from it). "stop" stops with an error before that step's update, "skip" skips the
    update on every rank (logged, counted in skipped_steps); both read the norm on the host once per step.
    fp16 always skips: its loss scaler handles overflows."""
    batch_check: Literal["shape", "dtype", "off"] = "shape"
    """train_batch/eval_batch compare every micro-batch with the first: structure, dtypes and shapes ("shape"),
    structure, dtypes and dimensions only ("dtype", for variable sequence lengths), or nothing ("off")."""
    batch_agreement: Literal["first_steps", "every_step", "off"] = "first_steps"
    """The ranks of one data-parallel replica (its tensor-, context- and pipeline-parallel peers) must be fed the
    same micro-batches; they compare a fingerprint of them (one all-gather of two numbers per rank per
    micro-batch) during the first optimizer step, on every step (a debug mode), or never, and all raise the same
    error naming the ranks."""
    loss: LossConfig = Field(default_factory=LossConfig)
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
    meta_init: Literal["replay", "sharded"] = "replay"
    """How initialize() fills a model built on the meta device (`paratrain.init_empty()`) when no load_weights is
    given: "replay" gives every tensor, bit for bit, the value eager construction with the same seed gives
    (every rank replays the model's initialization on full-size temporaries of one module at a time);
    "sharded" draws each rank's part only, in row blocks of at most 64Ki elements, with the same distribution
    but not eager's values (FSDP2-like; the same values in any layout; docs/big-models.md). No effect on a
    model with real tensors."""
    data_parallel: DataParallelConfig = Field(default_factory=DataParallelConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    """What a step trains on: next-token cross-entropy (the default), DPO and its family, GRPO's policy loss."""
    peft: PeftConfig | None = None
    """Low-rank adapters paratrain puts into the model (LoRA, DoRA); absent: the model is trained as it comes."""

    @model_validator(mode="after")
    def _replicas_shard(self) -> Config:
        hsdp = self.data_parallel.replicate > 1 or self.zero_optimization.mics_shard_size > 0
        if hsdp and self.zero_optimization.stage == 0:
            raise InvalidValueError("data_parallel.replicate (or zero_optimization.mics_shard_size) shards ZeRO's "
                                    "states inside groups of ranks and replicates across them, but "
                                    "zero_optimization.stage is 0 (DDP replicates everything already); set "
                                    "zero_optimization.stage to 1, 2 or 3, or remove it")
        return self

    @model_validator(mode="after")
    def _replica_groups(self) -> Config:
        ft = self.fault_tolerance
        if not ft.enabled:
            return self
        if self.zero_optimization.stage == 0:
            raise InvalidValueError("fault_tolerance sums the replica groups' ZeRO gradient shards (HSDP across the "
                                    "groups), but zero_optimization.stage is 0: set it to 1, 2 or 3")
        if ft.min_replicas > ft.replica_groups:
            raise InvalidValueError(f"fault_tolerance.min_replicas = {ft.min_replicas} is more than the "
                                    f"{ft.replica_groups} replica groups: no step could ever commit; set it to at "
                                    f"most fault_tolerance.replica_groups")
        failure = ft.inject_failure
        if failure is not None and failure.replica_group >= ft.replica_groups:
            raise InvalidValueError(f"fault_tolerance.inject_failure.replica_group = {failure.replica_group}, but the "
                                    f"groups are 0..{ft.replica_groups - 1}")
        if self.pipeline.stages > 1:
            raise InvalidValueError("fault_tolerance with pipeline.stages > 1 is not built: the groups' gradient sum "
                                    "is hooked into the non-pipeline step; use tensor, context or data parallelism "
                                    "inside each group")
        return self

    @model_validator(mode="after")
    def _pairs_for_dpo(self) -> Config:
        """Preference pairs train the dpo objective and the dpo objective trains on pairs; prompts are a grpo job's."""
        pairs = self.data.format == "preference"
        if pairs and self.objective.type != "dpo":
            raise InvalidValueError(f"data.format \"preference\" gives pairs, which the {self.objective.type} "
                                    f"objective does not train on: add \"objective\": {{\"type\": \"dpo\"}}, or "
                                    f"choose another data.format")
        prompts = self.data.format == "prompt"
        if prompts != (self.objective.type == "grpo") and (prompts or self.data.train):
            raise InvalidValueError(f"data.format \"prompt\" gives prompts to sample rollouts from, which a grpo job "
                                    f"trains on: set objective.type to \"grpo\" and data.format to \"prompt\" "
                                    f"together (got {self.objective.type} on \"{self.data.format}\")")
        if self.data.train and self.objective.type == "dpo" and not pairs:
            raise InvalidValueError(f"objective.type \"dpo\" trains on preference pairs, but data.format is "
                                    f"\"{self.data.format}\": set data.format to \"preference\" (records with "
                                    f"prompt, chosen, rejected)")
        return self

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.fp16.enabled and self.bf16.enabled:
            raise InvalidValueError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
        if self.torch_autocast.enabled and self.precision != "fp32":
            raise InvalidValueError(f"torch_autocast.enabled with {self.precision}.enabled: autocast keeps the model "
                                    f"in fp32 "
                                    f"and casts inside the forward, {self.precision} makes the model itself "
                                    f"{self.precision}; enable one of them")
        return self

    # ---- derived views ---------------------------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        return self.pipeline.stages * self.context_parallel.size * self.tensor_parallel.size

    def dp_size(self, world_size: int) -> int:
        """Ranks that draw different samples: the dp of the batch arithmetic, `ParallelDims.sample_parallel_size`
        once the mesh exists (context-parallel ranks share samples; gradients average over dp x cp)."""
        return world_size // self.model_parallel_size if self.data_parallel.size == -1 else self.data_parallel.size

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The layout on `world_size` ranks (raises MeshError, naming the sizes, when they do not fit)."""
        return ParallelDims(world_size, dp=self.dp_size(world_size), pp=self.pipeline.stages,
                            cp=self.context_parallel.size, tp=self.tensor_parallel.size,
                            cp_ulysses=self.context_parallel.cp_ulysses, ep=self.expert_parallel.size,
                            dp_replicate=self.dp_replicate(world_size))

    def dp_replicate(self, world_size: int) -> int:
        """HSDP's replicas: data_parallel.replicate, or DeepSpeed's MiCS group size read DeepSpeed's way (ZeRO
        shards over mics_shard_size ranks of dp x cp, the rest replicate)."""
        shard, replicate = self.zero_optimization.mics_shard_size, self.data_parallel.replicate
        if shard <= 0:
            return replicate
        cp, ranks = self.context_parallel.size, self.dp_size(world_size) * self.context_parallel.size
        if shard % cp or ranks % shard:
            raise ConfigError(f"zero_optimization.mics_shard_size {shard} must be a multiple of context_parallel.size "
                              f"{cp} that divides dp x cp = {ranks}; use one of "
                              f"{[s for s in range(cp, ranks + 1, cp) if ranks % s == 0]}")
        if "replicate" in self.data_parallel.model_fields_set and replicate != ranks // shard:
            raise ConfigError(f"zero_optimization.mics_shard_size {shard} means data_parallel.replicate "
                              f"{ranks // shard} on {world_size} ranks, but data_parallel.replicate is {replicate}; "
                              f"give one of the two")
        return ranks // shard

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

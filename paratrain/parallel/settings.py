"""The settings each strategy receives: its own typed config section and the few scalars it needs, never the
whole `Config` (the engine cuts them out of it: `paratrain.engine.strategies.strategies_of`).

A strategy is a function of (module, its dims of the mesh, its settings); what one strategy reads is written
here, so a new knob has one home and `parallelize` cannot reach past it into another strategy's section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from paratrain.config.parallel import (
    ActivationCheckpointingConfig,
    ContextParallelConfig,
    DataParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
)
from paratrain.config.training import ZeroConfig


@dataclass(frozen=True)
class TensorParallelSettings:
    """Step 1: the plan, sequence parallelism, and the seed of the tp random stream (dropout inside a shard)."""

    section: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    seed: int = 1234


@dataclass(frozen=True)
class PipelineSettings:
    """Steps 2 and 6: the split (stages, partition) and the runner (schedule, micro-batches, loss weighting)."""

    section: PipelineConfig = field(default_factory=PipelineConfig)
    micro_batch_size: int | None = None  # a spec builds its PipelineModule for this many rows
    micro_batches: int | None = None  # gradient_accumulation_steps: the runner's m
    token_loss: bool = False  # loss.reduction "token": the runner weighs micro-batches by their target tokens


@dataclass(frozen=True)
class DataParallelSettings:
    """Step 5: DDP (stage 0) or a ZeRO stage; `precision` is the model's (fp32 | bf16 | fp16), the gradient
    divides are DeepSpeed's prescale_gradients / gradient_predivide_factor, and `partial_backwards` says the
    pipeline schedule splits backward in two (ZeRO-2 then reduces at the window's end)."""

    section: DataParallelConfig = field(default_factory=DataParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    prescale_gradients: bool = False
    predivide_factor: float = 1.0
    partial_backwards: bool = False


@dataclass(frozen=True)
class Strategies:
    """Every strategy's settings for one `parallelize` call, in the order the steps apply."""

    tensor: TensorParallelSettings = field(default_factory=TensorParallelSettings)
    expert_parallel_size: int = 1
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    context: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    recompute: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    data: DataParallelSettings = field(default_factory=DataParallelSettings)
    autocast: bool = False  # torch_autocast.enabled: the forward runs under autocast

"""Typed, validated configuration (DeepSpeed-compatible keys plus parallelism sections)."""

from paratrain.config.errors import ConfigError
from paratrain.config.load import DEEPSPEED_UNSUPPORTED, load_config, resolve_batch
from paratrain.config.schema import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    Config,
    ContextParallelConfig,
    DataParallelConfig,
    ExpertParallelConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
    TrainerConfig,
    ZeroConfig,
)

__all__ = [
    "DEEPSPEED_UNSUPPORTED",
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ContextParallelConfig",
    "ExpertParallelConfig",
    "DataParallelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "TrainerConfig",
    "ZeroConfig",
    "load_config",
    "resolve_batch",
]

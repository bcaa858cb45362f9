"""paratrain: train one model across many processes with every classic parallel strategy.

The public API mirrors DeepSpeed's: `import paratrain as deepspeed` runs scripts written against DeepSpeed's
public API; DeepSpeed names paratrain does not implement raise an error that says so and what to use
(docs/deepspeed-compat.md).
"""

from paratrain import (  # paratrain.zero.estimate_memory; DeepSpeed's comm/zero/pipe names
    comm,
    models,  # registers the built-in model families' specs (GPT): checkpoint export --hf needs them
    moe,  # deepspeed.moe.layer.MoE
    zero,
)
from paratrain.api import add_config_arguments, from_pretrained, initialize, resolve_config, resolve_layout
from paratrain.checkpoint import CheckpointError
from paratrain.comm import CommStats, build_mesh
from paratrain.config import Config, ConfigError, load_config
from paratrain.distributed import init_distributed
from paratrain.engine import Engine
from paratrain.errors import Error
from paratrain.init.empty import init_empty
from paratrain.layout.mesh import Mesh, ParallelDims
from paratrain.parallel import pp as pipeline  # deepspeed.pipe
from paratrain.parallel.dp.dp import DataParallel
from paratrain.parallel.pp import LayerSpec, PipelineModule
from paratrain.precision import NonFiniteLossError
from paratrain.version import __version__

__all__ = [
    "CheckpointError",
    "CommStats",
    "Config",
    "ConfigError",
    "DataParallel",
    "DeepSpeedEngine",
    "Engine",
    "Error",
    "LayerSpec",
    "Mesh",
    "NonFiniteLossError",
    "ParallelDims",
    "PipelineModule",
    "__version__",
    "add_config_arguments",
    "build_mesh",
    "comm",
    "from_pretrained",
    "init_distributed",
    "init_empty",
    "initialize",
    "load_config",
    "models",
    "moe",
    "pipe",
    "pipeline",
    "resolve_config",
    "resolve_layout",
    "zero",
]

DeepSpeedEngine = Engine  # isinstance(engine, deepspeed.DeepSpeedEngine) holds
pipe = pipeline  # deepspeed.pipe.PipelineModule / LayerSpec


def __getattr__(name: str):
    """deepspeed.<name> that paratrain does not provide: an error naming it and the replacement."""
    from paratrain.compat.names import TOP_LEVEL, refuse

    refuse(TOP_LEVEL, "paratrain (as deepspeed)", name)

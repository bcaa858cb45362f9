"""paratrain: train one model across many processes with every classic parallel strategy.

The public API mirrors DeepSpeed's (`import paratrain as deepspeed` works for the common surface).
"""

from paratrain import zero  # paratrain.zero.estimate_memory
from paratrain.api import add_config_arguments, initialize, resolve_config
from paratrain.checkpoint import CheckpointError
from paratrain.comm import CommStats
from paratrain.config import Config, ConfigError, load_config
from paratrain.data_parallel.dp import DataParallel
from paratrain.distributed import init_distributed
from paratrain.engine import Engine
from paratrain.mesh import Mesh, ParallelDims, build_mesh
from paratrain.pipeline import LayerSpec, PipelineModule
from paratrain.precision import NonFiniteLossError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CommStats",
    "Config",
    "ConfigError",
    "DataParallel",
    "Engine",
    "LayerSpec",
    "Mesh",
    "NonFiniteLossError",
    "ParallelDims",
    "PipelineModule",
    "__version__",
    "add_config_arguments",
    "build_mesh",
    "init_distributed",
    "initialize",
    "load_config",
    "resolve_config",
    "zero",
]

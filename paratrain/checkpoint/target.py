"""What a checkpoint saves and loads, handed over by its owner: the checkpoint code never sees an engine.

    target = CheckpointTarget(model=parallel_model, optimizer=optimizer, mesh=mesh, config=config,
                              states={"train": train_state, "lr_scheduler": scheduler, "loss_scaler": scaler},
                              rank_states={"random": random_state})
    save_checkpoint(target, "ckpt")          # collective
    load_checkpoint(target, "ckpt")          # any layout loads any other

The model and its optimizer are saved as pieces of the original tensors (sharded, layout-independent,
`pieces.py`). Everything else is a stateful object (`state_dict()` / `load_state_dict()`, as torch's
schedulers have): `states` hold one copy for the whole job (rank 0's is written), `rank_states` one copy per
rank (each rank's is written; a load gives a rank its own back when the layout is the same, rank 0's
otherwise). A name that a checkpoint holds no state for is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from paratrain.config import Config
from paratrain.layout.mesh import Mesh
from paratrain.parallel.parallelize import ParallelModel


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class CheckpointTarget:
    model: ParallelModel  # the local module, its data-parallel strategy and the steps that made it
    optimizer: torch.optim.Optimizer  # its element-wise states are saved as pieces beside the model's
    mesh: Mesh
    config: Config  # recorded in the manifest; checkpoint.tag_validation and keep_last come from it
    states: dict[str, Stateful] = field(default_factory=dict)
    rank_states: dict[str, Stateful] = field(default_factory=dict)
    model_config: dict | None = None  # the model's own config (`ModelSpec.model_config`): export rebuilds from it

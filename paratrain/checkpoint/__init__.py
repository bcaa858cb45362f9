"""Sharded, layout-independent checkpoints: exact resume, resharding, export (docs/checkpoints.md)."""

from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.load import load_checkpoint
from paratrain.checkpoint.save import save_checkpoint
from paratrain.checkpoint.target import CheckpointTarget, Stateful

__all__ = ["CheckpointError", "CheckpointTarget", "Stateful", "load_checkpoint", "save_checkpoint"]

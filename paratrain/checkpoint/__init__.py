"""Sharded, layout-independent checkpoints: exact resume, resharding, export (docs/checkpoints.md)."""

from paratrain.checkpoint.format import CheckpointError
from paratrain.checkpoint.load import load_checkpoint
from paratrain.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

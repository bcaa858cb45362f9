"""Helpers for multi-process tests and for `paratrain verify`: a reusable spawned world and comparisons."""

from paratrain.testing.compare import max_rel_diff, rel_diff
from paratrain.testing.world import World, WorldError

__all__ = ["World", "WorldError", "max_rel_diff", "rel_diff"]

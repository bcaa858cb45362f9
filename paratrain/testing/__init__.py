"""Helpers for multi-process tests and for `paratrain verify`: a reusable spawned world, comparisons, and a
host-read counter."""

from paratrain.testing.compare import max_rel_diff, rel_diff
from paratrain.testing.host_syncs import HostSyncs
from paratrain.testing.world import World, WorldError

__all__ = ["HostSyncs", "World", "WorldError", "max_rel_diff", "rel_diff"]

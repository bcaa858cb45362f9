"""ZeRO-3's checkpoint hooks and introspection: what its shards hold (masters, frozen weights), in what layout,
and how many bytes; mixed into `FullyShardedDataParallel` (fsdp.py), whose units and flat buffers it reads."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratrain.muon import MasterLayout
from paratrain.parallel.dp.base import MasterSegment
from paratrain.parallel.dp.fsdp_units import units_full_state, units_memory_stats


class ShardedState:
    """Mixed into `FullyShardedDataParallel`: uses its `_flats()`, `_frozen()`, `_all_units()`, optimizer,
    offload policy and placements."""

    @contextmanager
    def gathered_for_inference(self):
        """Every unit gathered once and kept (reshard skips a kept unit) for a run of forwards without
        gradients: generation gathers the model once per call, never per token. Freed after (also on error)."""
        units = self._all_units()
        kept = [unit.keep for unit in units]
        for unit in units:
            unit.keep = True
            unit.gather()  # all in flight together, then waited for
        try:
            for unit in units:
                unit.wait()
            yield
        finally:
            for unit, keep in zip(units, kept):
                unit.keep = keep
                unit.reshard()

    # ---- checkpoint hooks ---------------------------------------------------------------------------
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        return [(f.master.param, f.layout.master_segments()) for f in self._flats()]

    def frozen_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        return [(f.shard, f.segments()) for f in self._frozen()]

    @property
    def named_frozen(self) -> list[tuple[str, nn.Parameter]]:
        return [(slot.name, slot.param) for f in self._frozen() for slot in f.layout.slots]

    def muon_layouts(self) -> list[tuple[torch.Tensor, MasterLayout]]:
        return [(f.master.param, f.layout.muon_layout(f.axis, self.placements.of)) for f in self._flats()]

    @property
    def masters_replicated(self) -> bool:
        return False

    def masters_loaded(self) -> None:
        """Refresh the device copies of the shards and drop whatever is gathered: the next forward gathers
        the loaded values."""
        self.zero_grad()
        for flat in self._flats():
            flat.refresh_device_shard()
        for unit in self._all_units():
            unit.reshard()
            unit.gathered = False

    # ---- introspection ----------------------------------------------------------------------------
    def gathered_units(self) -> list[str]:
        """Names of the units whose full parameters are materialized on this rank right now."""
        return [u.name for u in self._all_units() if (u.flats or u.frozen) and u.allocated_bytes() > 0]

    def padded_numel(self) -> int:
        return sum(f.layout.padded for f in self._flats())

    def padded_frozen_numel(self) -> int:
        """The frozen elements this strategy shards, padded per buffer (N × the elements each rank keeps)."""
        return sum(f.layout.padded for f in self._frozen())

    def memory_stats(self) -> dict[str, int]:
        return units_memory_stats(self._flats(), self._frozen(), self.optimizer, self.reduce_at_boundary, self.offload)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return units_full_state(self.module, self._flats(), self._frozen(), self.offload.device)


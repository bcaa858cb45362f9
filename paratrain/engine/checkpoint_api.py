"""The engine's checkpoints, weights and live state (a mixin of `Engine`): DeepSpeed's save_checkpoint and
load_checkpoint, weights and adapters in and out, asynchronous saves' waits and timings, and the live state a
replica group heals from. The work is `engine/checkpoints.py`'s, `engine/weights.py`'s and `engine/live_state.py`'s;
these are the calls."""

from __future__ import annotations

from paratrain.engine.live_state import live_state, load_live_state
from paratrain.engine.replicas import ReplicaGroups
from paratrain.engine.weights import load_adapter, load_weights


class CheckpointAPI:
    def checkpoint_target(self, states: bool = True, lr_scheduler: bool = True):
        """The model, optimizer and stateful objects a checkpoint saves or loads (without `states`: the model
        and optimizer only)."""
        return self._checkpoints.target(states, lr_scheduler)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool | None = None) -> bool:
        """Save everything needed to continue exactly (collective). `tag` defaults to global_step{N};
        `exclude_frozen_parameters` to the config's checkpoint.exclude_frozen_parameters."""
        self._checkpoints.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        return True

    def join_replica_groups(self, groups: ReplicaGroups) -> None:
        """Sum every step's gradients and token counts with the other replica groups, and apply a step only when
        they commit it (else `StepDiscarded`); `engine/replicas.py`, docs/fault-tolerance.md."""
        self.replica_groups = groups
        self.grad_sync.final_gradient_hook = groups.final_gradient  # ZeRO-3: sums start during the backward

    def live_state(self) -> dict:
        """This rank's whole training state, by reference, for a peer in the same layout (engine/live_state.py)."""
        return live_state(self._checkpoints.target(), self._window.unit)

    def load_live_state(self, state: dict) -> None:
        """A peer's `live_state` into this rank: after it, this rank trains on as the peer would."""
        self._window.unit = load_live_state(self._checkpoints.target(), state)
        self._checkpoints.base_changed()

    def wait_for_checkpoint(self) -> None:
        """With checkpoint.async_save: block until the save in flight is written and `latest` names it, and raise
        its error (every rank). Loads, the next save and `destroy` wait by themselves."""
        self._checkpoints.wait()

    def checkpoint_timings(self) -> dict[str, float]:
        """Since the last call: the last save's stall (checkpoint/stall_s, the call until training goes on) and step
        (checkpoint/step), and its write time (checkpoint/write_s; an asynchronous save's once written). Empty when
        neither is new."""
        return self._checkpoints.take_timings()

    def hold_scheduled_saves(self) -> None:
        """From now on the saves `checkpoint.save_every` schedules wait for `save_held_checkpoint()`. A job that logs
        each step calls it after writing the step's row, so no checkpoint names a step whose row a kill between the
        save and the write would lose (a resumed job keeps the rows up to the checkpoint's step)."""
        self._checkpoints.hold_scheduled = True

    def save_held_checkpoint(self) -> None:
        """The scheduled save held back by `hold_scheduled_saves`, if one is due (collective; nothing otherwise)."""
        self._checkpoints.save_held()

    @property
    def checkpoint_saves(self) -> list[dict]:
        """Every save this engine made: tag, step, async, stall_s, write_s (None while an asynchronous one is being
        written) and, asynchronous, staged_bytes (this rank's host copy)."""
        return [dict(r) for r in self._checkpoints.saves]

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Load a checkpoint saved under any layout (collective); returns (path, client_state), (None, None)
        when `load_dir` holds none. `tag` defaults to the one the `latest` file names."""
        return self._checkpoints.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only)

    def load_weights(self, path, name_map=None, strict: bool = True) -> set[str]:
        """Model weights only, from safetensors (file, directory, HF sharded) or a paratrain checkpoint; each rank
        reads its slices (collective). `name_map`: {weights' name: model name}, or a function (None: skip). An
        adapted model's base takes the names it has without adapters ("q_proj.weight" fills
        "q_proj.base_layer.weight"); adapters the weights do not hold keep their values. Returns those names."""
        self._checkpoints.base_changed()
        return load_weights(self.parallel, self.mesh, self._adapter_tensors, path, name_map, strict)

    def load_adapter(self, directory) -> None:
        """An adapter directory's weights (peft's format: adapter_model.safetensors) into the model's adapters, each
        rank reading its slices (collective); its adapter_config.json must describe the same adapters."""
        load_adapter(self.parallel, self.mesh, self.adapters, directory)

    def save_pretrained(self, save_directory, max_shard_size: int | str = "5GB", dtype=None,
                        merged: bool = False) -> None:
        """The model as a directory `from_pretrained` loads (transformers' too): config files, safetensors
        shards of at most `max_shard_size` (+ index), the tokenizer; from any layout (collective: a tensor at
        a time, rank 0 writes, atomic). `dtype` ("bf16", torch.bfloat16): cast floating tensors (default fp32).
        A model with adapters writes the adapter in peft's format (`PeftModel.from_pretrained` loads it), or,
        `merged`, the model with every adapter folded into its base weight (`merge_peak_bytes`: what rank 0 held
        at most for it, counted)."""
        self._checkpoints.save_pretrained(save_directory, max_shard_size, dtype, merged, self.adapters, self.tokenizer)

    @property
    def merge_peak_bytes(self) -> int:
        """Bytes rank 0 held at most for the last merged `save_pretrained` (0 before one)."""
        return self._checkpoints.merge_peak_bytes


"""The engine's state beyond the step: checkpoints (paratrain/checkpoint, docs/checkpoints.md) and
introspection (communication and memory counted, the full state dict, timings)."""

from __future__ import annotations

import torch


class EngineStateAPI:
    """A mixin of `Engine`; it uses the engine's config, pmesh, grad_sync, parallel and _times."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save everything needed to continue exactly (collective). `tag` defaults to global_step{N}."""
        from paratrain.checkpoint import save_checkpoint

        save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Load a checkpoint saved under any layout (collective); returns (path, client_state), (None, None)
        when `load_dir` holds none. `tag` defaults to the one the `latest` file names."""
        from paratrain.checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)

    def _save_if_due(self) -> None:
        every = self.config.checkpoint.save_every
        if every and self.global_steps % every == 0:
            self.save_checkpoint(self.config.checkpoint.dir)

    # ---- introspection ---------------------------------------------------------------------------
    def comm_stats(self, reset: bool = False, by_tag: bool = False) -> dict:
        """Collectives since the last reset: {axis: {op: {calls, elements, bytes}}}."""
        out = self.pmesh.stats.snapshot(by_tag=by_tag)
        if reset:
            self.pmesh.stats.reset()
        return out

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model state this rank holds: params, grads, optimizer_state, total."""
        return self.grad_sync.memory_stats()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete, unsharded state dict under the original names, on every rank."""
        from paratrain.checkpoint.pieces import gather_full_state

        return gather_full_state(self.parallel, self.pmesh, self.device)

    def timings(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent so far in forward, backward, step (with comm_wait, the wait for gradient reductions,
        inside it) and, with a pipeline, the pipeline's part of the step."""
        out = dict(self._times)
        if reset:
            self._times.clear()
        return out

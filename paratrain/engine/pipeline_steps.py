"""The engine's whole pipeline steps (`pipeline.stages > 1`): a step's micro-batches in their normal form, the
runner's schedule, and the token-weighted loss shared over pp in the runner's all-reduce (`engine/token_loss.py`).
A mixin of `Engine`, which owns everything used here."""

from __future__ import annotations

import torch

from paratrain.data.batch_check import BatchChecker
from paratrain.data.micro_batch import as_micro_batch
from paratrain.data.nested import to_device
from paratrain.engine.token_loss import target_positions
from paratrain.errors import InvalidValueError


class PipelineSteps:
    def _train_pipeline(self, data_iter) -> torch.Tensor:
        """Every rank of a dp replica draws the same micro-batches; the first stage uses the inputs, the last
        the targets. The runner accumulates the step's gradients; the update is the engine's as always."""
        count = self.gradient_accumulation_steps()
        batches = [self._pipeline_batch(next(data_iter), self._check_train_batch) for _ in range(count)]
        self._check_agreement(batches)
        if self.objective is not None:  # the reference log-probs the batches lack: a forward-only pass first
            self.objective.prepare_pipeline(batches)
        unit = self._window.set_unit(target_positions(batches[0]), count)
        with self._timed("pipeline"):
            losses = self.pipeline.train_step(batches, unit)
        grad_scale = 1.0
        if losses.token_weighted:  # every pp rank holds the step's sums: one count exchange over dp x cp
            self._window.add(losses.total, losses.weight)
            mean, grad_scale, self._objective_metrics = self._window.finish(losses.extra)
        else:
            mean = self._mean_over_dp(losses.mean.to(self.device))
        self._window.reset()
        self._reporter.record_loss(mean)
        with self._timed("step"):
            self._optimizer_update(grad_scale)
        self.train_state.micro_steps += count
        self.train_state.global_samples += self.train_micro_batch_size_per_gpu() * self.mesh.size("dp") * count
        self._reporter.after_step(self)
        self._save_if_due()
        return mean

    def _pipeline_batch(self, batch, check: BatchChecker):
        """A pipeline micro-batch: token data in its normal form (transformers' dicts too), else the pair."""
        check(batch)
        # token data in its normal form from the loader's tensors, before the copy (data/token_layout.py's note)
        token = as_micro_batch((), batch) if isinstance(batch, dict) else \
            as_micro_batch(tuple(batch), {}) if isinstance(batch, (tuple, list)) else None
        if token is None and isinstance(batch, dict):
            raise InvalidValueError(f"a pipeline micro-batch dict must be token data (input_ids with labels or "
                                    f"targets, optionally attention_mask, position_ids, cu_seq_lens_q), got keys "
                                    f"{sorted(batch)}")
        return to_device(batch, self.device) if token is None else token.to(self.device)

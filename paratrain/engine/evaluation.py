"""The engine's evaluation and its means over ranks: `eval_batch` (DeepSpeed's PipelineEngine signature) runs
micro-batches without updating and returns the loss averaged over every rank's target tokens (token-weighted)
or over the ranks' means. A mixin of `Engine`, which owns everything used here."""

from __future__ import annotations

import torch

import paratrain.comm as comm
from paratrain.engine.deepspeed_api import check_eval_arguments


class Evaluation:
    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over `num_micro_batches` (default: gradient_accumulation_steps) without updating.
        DeepSpeed's PipelineEngine signature; only its defaults are supported (the loss, averaged)."""
        check_eval_arguments(return_logits, compute_loss, reduce_output, bcast_loss)
        with self._together():
            return self._eval_batch(data_iter, num_micro_batches)

    def _eval_batch(self, data_iter, num_micro_batches: int | None) -> torch.Tensor:
        was_training = self.module.training
        self.module.eval()
        count = num_micro_batches or self.gradient_accumulation_steps()
        try:
            if self.pipeline is not None:
                return self._eval_pipeline(data_iter, count)
            sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, weight)
            weighted = False
            for _ in range(count):
                loss = self._run_micro_batch(next(data_iter))
                batch, self._last_batch = self._last_batch, None
                part, token = self._window.evaluate(loss, batch)
                sums += part
                weighted |= token
            return self._mean_of(sums, weighted)
        finally:
            self.module.train(was_training)

    def _mean_of(self, sums: torch.Tensor, token_weighted: bool) -> torch.Tensor:
        """An evaluation's mean from this rank's (loss sum, weight): over every rank's target tokens when
        token-weighted, else the mean of the ranks' means."""
        if token_weighted:
            comm.all_reduce(sums, self.mesh.axis("dp_cp"), tag="metrics")
            return (sums[0] / sums[1].clamp(min=1)).float()
        return self._mean_over_dp((sums[0] / sums[1]).float())

    def _mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        axis = self.mesh.axis("dp_cp")
        comm.all_reduce(value, axis, tag="metrics")
        return value / axis.size

"""The engine's evaluation and its means over ranks: `eval_batch` (DeepSpeed's PipelineEngine signature) runs
micro-batches without updating and returns the loss averaged over every rank's target tokens (token-weighted)
or over the ranks' means; `evaluate` does the same over a whole dataset, each rank reading its data-parallel
share. A mixin of `Engine`, which owns everything used here.

[Note: an exact mean over a dataset whose rows do not divide among the ranks]
Every rank must run the same number of forwards (ZeRO-3 gathers, tensor-parallel reductions and a pipeline's
schedule are collectives), but N rows rarely divide into micro_batch x dp. Instead of dropping the tail,
the missing rows are masked copies of a real row (every label -100): they run through the model and add no
target token, so the token-weighted mean is sum(token losses of the N rows) / (their target tokens), the
number one process computes over the same rows. Ranks agree on how many micro-batches are left with one
all-reduce of a count per round, so an iterable whose ranks hold unequal shares is padded the same way.
Objective data is padded the same way: a preference pair with empty completions (completion_mask all zero),
which the dpo objective does not count (it counts a pair only when both completions have a token).

[Note: an objective's metrics in an evaluation]
The objective's head adds its metrics (rewards/accuracies, ...) into the sums the next optimizer step reports.
An evaluation sets the sums gathered so far aside, runs, takes its own and puts the others back, so evaluating
between (or inside) training steps changes no training metric; its own are reduced over dp x cp in the loss's
all-reduce and read with `engine.evaluation_metrics()`.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager

import torch

import paratrain.comm as comm
from paratrain.data.batch_check import BatchChecker
from paratrain.data.datasets import default_collate
from paratrain.data.micro_batch import IGNORE
from paratrain.engine.deepspeed_api import check_eval_arguments
from paratrain.errors import InvalidValueError


class Evaluation:
    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over `num_micro_batches` (default: gradient_accumulation_steps) without updating.
        DeepSpeed's PipelineEngine signature; only its defaults are supported (the loss, averaged)."""
        check_eval_arguments(return_logits, compute_loss, reduce_output, bcast_loss)
        with self._together(), self._metrics_apart():
            return self._eval_batch(data_iter, num_micro_batches)

    def _eval_batch(self, data_iter, num_micro_batches: int | None) -> torch.Tensor:
        was_training = self.module.training
        self.module.eval()
        try:
            batches = [next(data_iter) for _ in range(num_micro_batches or self.gradient_accumulation_steps())]
            return self._mean_of(*self._evaluate_round(batches))
        finally:
            self.module.train(was_training)

    def _mean_of(self, sums: torch.Tensor, token_weighted: bool) -> torch.Tensor:
        """An evaluation's mean from this rank's (loss sum, weight): over every rank's target tokens when
        token-weighted (an objective's metric sums in the same all-reduce), else the mean of the ranks' means."""
        if token_weighted:
            extra = self.objective.take_metrics() if self.objective is not None else None
            both = sums if extra is None else torch.cat([sums, extra.to(sums.device, torch.float64)])
            comm.all_reduce(both, self.mesh.axis("dp_cp"), tag="metrics")
            self._evaluation_sums = None if extra is None else both[2:]
            return (both[0] / both[1].clamp(min=1)).float()
        return self._mean_over_dp((sums[0] / sums[1]).float())

    @contextmanager
    def _metrics_apart(self):
        """The objective's metric sums of the step in progress set aside while an evaluation runs (the note)."""
        self._evaluation_sums = None
        if self.objective is None:
            yield
            return
        kept, head_training = self.objective.take_metrics(), self.objective.head.training
        self.objective.head.eval()  # a pipeline's head is no child of the module: it counts in eval mode only
        try:
            yield
        finally:
            self.objective.take_metrics()
            self.objective.metrics.sums.copy_(kept)
            self.objective.head.train(head_training)

    def evaluation_metrics(self) -> dict[str, float]:
        """The last evaluation's objective metrics over its whole data (TRL's names: rewards/accuracies, ...;
        the trainer logs them as eval/...); one host read. Empty for next-token loss."""
        sums = getattr(self, "_evaluation_sums", None)
        if self.objective is None or sums is None:
            return {}
        return self.objective.metrics.values(sums)

    def _mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        axis = self.mesh.axis("dp_cp")
        comm.all_reduce(value, axis, tag="metrics")
        return value / axis.size

    @torch.no_grad()
    def evaluate(self, data, max_batches: int | None = None, collate_fn=None) -> torch.Tensor:
        """The loss over a whole dataset without updating: sum of every target token's loss / number of target
        tokens over all rows (one process's number, in every layout; see the note), or the objective's over its
        unit (pairs for dpo; its metrics then in `evaluation_metrics()`). `data`: rows (a map-style Dataset or a
        list: each rank takes its data-parallel share, micro_batch rows at a time, collated by `collate_fn` (default:
        the training loader's), the tail padded with masked rows) or an iterable of this rank's micro-batches (a
        DataLoader). `max_batches`: at most this many micro-batches per rank. The model returns to the mode it was
        in."""
        if max_batches is not None and max_batches < 1:
            raise InvalidValueError(f"engine.evaluate(max_batches={max_batches}): pass a positive number of "
                                    f"micro-batches per rank, or None for the whole dataset")
        with self._together(), self._metrics_apart():
            was_training, checker = self.module.training, self._check_eval_batch
            # a dataset's micro-batches are compared with its own first one, not with another dataset's
            self._check_eval_batch = BatchChecker(self.config.batch_check, "evaluation")
            self.module.eval()
            try:
                return self._evaluate(self._rank_share(data, collate_fn), max_batches)
            finally:
                self.module.train(was_training)
                self._check_eval_batch = checker

    def _rank_share(self, data, collate_fn=None):
        """This rank's micro-batches: rows split as the training sampler splits them (micro-step j of dp rank r
        takes rows [(j·dp + r)·micro, ... + micro)), or the iterable as given."""
        if not _is_rows(data):
            return iter(data)
        collate = collate_fn or getattr(self.training_dataloader, "collate_fn", None) or default_collate
        if len(data) == 0:
            raise InvalidValueError("engine.evaluate got a dataset of 0 rows; pass at least one row")
        micro, dp, rank = self.train_micro_batch_size_per_gpu(), self.mesh.size("dp"), self.mesh.local_rank("dp")
        rounds = math.ceil(len(data) / (micro * dp))
        return (collate([data[i] if i < len(data) else _masked(data[0])
                                 for i in range((j * dp + rank) * micro, (j * dp + rank + 1) * micro)])
                for j in range(rounds))

    def _evaluate(self, batches, max_batches: int | None) -> torch.Tensor:
        """Rounds of micro-batches (a pipeline's: one schedule of gradient_accumulation_steps of them) until
        every rank's share is spent; a rank with fewer runs masked copies (the note)."""
        round_size = self.gradient_accumulation_steps() if self.pipeline is not None else 1
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, weight)
        weighted, template, taken = False, None, 0
        while max_batches is None or taken < max_batches:
            want = round_size if max_batches is None else min(round_size, max_batches - taken)
            own = list(itertools.islice(batches, want))
            template = template if template is not None or not own else own[0]
            most = torch.tensor([len(own)], dtype=torch.int64)
            comm.all_reduce(most, self.mesh.world, op="max", tag="metrics")
            if int(most) == 0:
                break
            if template is None:
                raise InvalidValueError("engine.evaluate: this rank's data gave no micro-batch while another "
                                        "rank's did; give every rank at least one micro-batch (or pass rows)")
            padded = own + [_masked(template)] * ((round_size if self.pipeline is not None else int(most)) - len(own))
            part, token = self._evaluate_round(padded)
            sums += part
            weighted |= token
            taken += want
        return self._mean_of(sums, weighted)

    def _evaluate_round(self, batches: list) -> tuple[torch.Tensor, bool]:
        """(loss sum, weight) of one round on this rank, and whether it is token-weighted."""
        if self.pipeline is not None:
            batches = [self._pipeline_batch(b, self._check_eval_batch) for b in batches]
            # a pipeline step takes the objective's metric sums (its step_extras, summed over pp): those of the
            # rounds so far are kept apart and put back with this round's
            so_far = self.objective.take_metrics() if self.objective is not None else None
            if self.objective is not None:  # the reference log-probs the batches lack, as in training
                self.objective.prepare_pipeline(batches)
            losses = self.pipeline.eval_step(batches)
            if so_far is not None:
                self.objective.metrics.sums += so_far + (0 if losses.extra is None else losses.extra.to(so_far))
            part = torch.stack([losses.total, losses.weight]).to(self.device, torch.float64)
            return part, losses.token_weighted
        part = torch.zeros(2, dtype=torch.float64, device=self.device)
        token = False
        for batch in batches:
            loss = self._run_micro_batch(batch)
            micro, self._last_batch = self._last_batch, None
            one, token = self._window.evaluate(loss, micro)
            # a micro-batch of masked rows has no target: some models' mean over none is NaN (0 / 0)
            part += torch.where(one[1] > 0, one, torch.zeros_like(one)) if token else one
        return part, token


def _is_rows(data) -> bool:
    """Rows (indexable and sized), not an iterable of micro-batches (a DataLoader has no __getitem__)."""
    return hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, dict)


def _masked(sample):
    """A copy of a row or micro-batch whose every target is ignored (labels / targets -100); of objective data,
    with no completion token (a preference pair's completions empty, a collated completion_mask all zero)."""
    if isinstance(sample, dict) and "chosen_ids" in sample:
        return {**sample, "chosen_ids": [], "rejected_ids": []}
    if isinstance(sample, dict) and "completion_mask" in sample:
        return {**sample, "completion_mask": torch.zeros_like(sample["completion_mask"])}
    if isinstance(sample, dict) and ("labels" in sample or "targets" in sample):
        return {k: torch.full_like(v, IGNORE) if k in ("labels", "targets") else v for k, v in sample.items()}
    if isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[1], torch.Tensor):
        return type(sample)((sample[0], torch.full_like(sample[1], IGNORE)))
    raise InvalidValueError(f"engine.evaluate pads the ranks' shares with masked rows, which needs token data: a "
                            f"dict with labels or targets (or objective data: chosen_ids / completion_mask), or a "
                            f"pair (inputs, targets); got "
                            f"{type(sample).__name__}. Give rows in one of those forms, or a row count that is a "
                            f"multiple of micro_batch x dp")

"""The engine's evaluation and its means over ranks: `eval_batch` (DeepSpeed's PipelineEngine signature) runs
micro-batches without updating and returns the loss averaged over every rank's target tokens (token-weighted)
or over the ranks' means; `evaluate` does the same over a whole dataset, each rank reading its data-parallel
share. A part of the engine (`Evaluator`): it runs micro-batches through the step's `ForwardPass` and weighs them
with the step's `LossWindow`, and changes neither.

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
from collections.abc import Callable
from contextlib import contextmanager

import torch

import paratrain.comm as comm
from paratrain.data.datasets import default_collate
from paratrain.data.micro_batch import IGNORE
from paratrain.engine.forward_pass import ForwardPass
from paratrain.engine.objective_step import ObjectiveStep
from paratrain.engine.phases import Phases
from paratrain.engine.token_loss import LossWindow, mean_over_ranks
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Mesh


class Evaluator:
    def __init__(self, forward: ForwardPass, objective: ObjectiveStep | None, window: LossWindow, mesh: Mesh,
                 device: torch.device, phases: Phases, accumulation: Callable[[], int], micro_batch_size: int,
                 default_collate_fn: Callable | None):
        self.forward, self.objective, self.window = forward, objective, window
        self.parallel, self.mesh, self.device, self.phases = forward.parallel, mesh, device, phases
        self.accumulation, self.micro_batch_size = accumulation, micro_batch_size
        self.default_collate_fn = default_collate_fn or default_collate
        self.sums: torch.Tensor | None = None  # the last evaluation's objective metric sums, reduced

    @torch.no_grad()
    def eval_batch(self, data_iter, num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over `num_micro_batches` (default: gradient_accumulation_steps) without updating."""
        with self.phases.together(), self._metrics_apart(), self._in_eval_mode():
            batches = [next(data_iter) for _ in range(num_micro_batches or self.accumulation())]
            return self._mean_of(*self._evaluate_round(batches))

    @torch.no_grad()
    def evaluate(self, data, max_batches: int | None = None, collate_fn=None) -> torch.Tensor:
        """`engine.evaluate` (its docstring says what it computes)."""
        if max_batches is not None and max_batches < 1:
            raise InvalidValueError(f"engine.evaluate(max_batches={max_batches}): pass a positive number of "
                                    f"micro-batches per rank, or None for the whole dataset")
        with self.phases.together(), self._metrics_apart(), self.forward.own_evaluation_checker(), \
                self._in_eval_mode():
            return self._evaluate(self._rank_share(data, collate_fn), max_batches)

    def metrics(self) -> dict[str, float]:
        """The last evaluation's objective metrics over its whole data; one host read. Empty for next-token loss."""
        if self.objective is None or self.sums is None:
            return {}
        return self.objective.metrics.values(self.sums)

    @contextmanager
    def _in_eval_mode(self):
        """The model in eval mode, and back in the mode it was in."""
        module = self.parallel.module
        was_training = module.training
        module.eval()
        try:
            yield
        finally:
            module.train(was_training)

    def _mean_of(self, sums: torch.Tensor, token_weighted: bool) -> torch.Tensor:
        """An evaluation's mean from this rank's (loss sum, weight): over every rank's target tokens when
        token-weighted (an objective's metric sums in the same all-reduce), else the mean of the ranks' means."""
        if token_weighted:
            extra = self.objective.take_metrics() if self.objective is not None else None
            both = sums if extra is None else torch.cat([sums, extra.to(sums.device, torch.float64)])
            comm.all_reduce(both, self.mesh.axis("dp_cp"), tag="metrics")
            self.sums = None if extra is None else both[2:]
            return (both[0] / both[1].clamp(min=1)).float()
        return mean_over_ranks((sums[0] / sums[1]).float(), self.mesh.axis("dp_cp"))

    @contextmanager
    def _metrics_apart(self):
        """The objective's metric sums of the step in progress set aside while an evaluation runs (the note)."""
        self.sums = None
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

    def _rank_share(self, data, collate_fn=None):
        """This rank's micro-batches: rows split as the training sampler splits them (micro-step j of dp rank r
        takes rows [(j·dp + r)·micro, ... + micro)), or the iterable as given."""
        if not _is_rows(data):
            return iter(data)
        collate = collate_fn or self.default_collate_fn
        if len(data) == 0:
            raise InvalidValueError("engine.evaluate got a dataset of 0 rows; pass at least one row")
        micro, dp, rank = self.micro_batch_size, self.mesh.size("dp"), self.mesh.local_rank("dp")
        rounds = math.ceil(len(data) / (micro * dp))
        return (collate([data[i] if i < len(data) else _masked(data[0])
                                 for i in range((j * dp + rank) * micro, (j * dp + rank + 1) * micro)])
                for j in range(rounds))

    def _evaluate(self, batches, max_batches: int | None) -> torch.Tensor:
        """Rounds of micro-batches (a pipeline's: one schedule of gradient_accumulation_steps of them) until
        every rank's share is spent; a rank with fewer runs masked copies (the note)."""
        pipeline = self.parallel.pipeline is not None
        round_size = self.accumulation() if pipeline else 1
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
            padded = own + [_masked(template)] * ((round_size if pipeline else int(most)) - len(own))
            part, token = self._evaluate_round(padded)
            sums += part
            weighted |= token
            taken += want
        return self._mean_of(sums, weighted)

    def _evaluate_round(self, batches: list) -> tuple[torch.Tensor, bool]:
        """(loss sum, weight) of one round on this rank, and whether it is token-weighted."""
        if self.parallel.pipeline is not None:
            return self._pipeline_round(batches)
        part = torch.zeros(2, dtype=torch.float64, device=self.device)
        token = False
        for batch in batches:
            loss = self.forward.run(batch)
            one, token = self.window.evaluate(loss, self.forward.take_last())
            # a micro-batch of masked rows has no target: some models' mean over none is NaN (0 / 0)
            part += torch.where(one[1] > 0, one, torch.zeros_like(one)) if token else one
        return part, token

    def _pipeline_round(self, batches: list) -> tuple[torch.Tensor, bool]:
        batches = [self.forward.pipeline_batch(b) for b in batches]
        # a pipeline step takes the objective's metric sums (its step_extras, summed over pp): those of the
        # rounds so far are kept apart and put back with this round's
        so_far = self.objective.take_metrics() if self.objective is not None else None
        if self.objective is not None:  # the reference log-probs the batches lack, as in training
            self.objective.prepare_pipeline(batches)
        losses = self.parallel.pipeline.eval_step(batches)
        if so_far is not None:
            self.objective.metrics.sums += so_far + (0 if losses.extra is None else losses.extra.to(so_far))
        part = torch.stack([losses.total, losses.weight]).to(self.device, torch.float64)
        return part, losses.token_weighted


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

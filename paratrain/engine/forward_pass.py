"""The forward of one micro-batch in the training layout, a part of the engine that training and evaluation share.

Token data (ids with targets, transformers' `labels`, `attention_mask`, packing, an objective's fields) is
brought to its normal form (`paratrain.data.micro_batch`), checked against the peers of its replica and against
the first micro-batch's shapes, split for context parallelism, given the objective's reference log-probs it lacks,
and run through the model's spec with the micro-batch in flight (the objective's head reads it). Anything else
goes to the model as it is. The token micro-batch of the last forward is kept for the backward, which weighs its
loss by its target count (`engine/token_loss.py`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from paratrain.comm import gather_from_region
from paratrain.data.agreement import FIRST_STEPS, check_same_batches
from paratrain.data.batch_check import BatchChecker
from paratrain.data.micro_batch import MicroBatch, as_micro_batch, in_flight, loss_of_output, split_loss
from paratrain.data.nested import to_device
from paratrain.engine.objective_step import ObjectiveStep
from paratrain.engine.phases import Phases
from paratrain.engine.train_state import TrainState
from paratrain.errors import InvalidValueError, RunError
from paratrain.layout.mesh import Mesh
from paratrain.parallel.tp.loss import VocabParallelCrossEntropy


class ForwardPass:
    def __init__(self, parallel, objective: ObjectiveStep | None, mesh: Mesh, device: torch.device,
                 batch_check: str, batch_agreement: str, train_state: TrainState, phases: Phases):
        self.parallel, self.objective, self.mesh, self.device = parallel, objective, mesh, device
        self.batch_check, self.batch_agreement = batch_check, batch_agreement
        self.train_state, self.phases = train_state, phases
        self.check_train = BatchChecker(batch_check, "training")
        self.check_eval = BatchChecker(batch_check, "evaluation")
        self.last_batch: MicroBatch | None = None  # the token micro-batch of the last forward, for its count

    def take_last(self) -> MicroBatch | None:
        batch, self.last_batch = self.last_batch, None
        return batch

    def __call__(self, batch: MicroBatch | None, inputs: tuple, kwargs: dict):
        """Run token data (`batch`, already on the device) through the model's spec, anything else as given."""
        self.last_batch = None
        with self.phases.timed("forward"), self.parallel.autocast():
            self.check_agreement([batch if batch is not None else (inputs, kwargs)])
            if batch is None:
                self.parallel.check_unsplit(inputs, kwargs)
                return self.parallel.module(*inputs, **kwargs)
            if batch.targets is None:  # the model's outputs (logits): whole, never this rank's slice unsaid
                return self._whole_outputs(batch)
            batch = self.parallel.prepare_batch(batch)
            if self.objective is not None:  # the reference log-probs the batch lacks, on the same split
                self.objective.prepare(batch)
            self.last_batch = batch
            with in_flight(batch):
                return self.parallel.spec.call(self.parallel.module, batch)

    def _whole_outputs(self, batch: MicroBatch):
        """A forward without targets returns the logits over the whole vocabulary (gathered over tp, with the
        gradient going back to each rank's slice); under context parallelism it is refused by name: each rank
        holds a chunk of the sequence, and a loss of the user's over gathered chunks would be counted cp times."""
        if self.parallel.context is not None:
            raise RunError("engine(...) without targets under context parallelism would return this rank's chunk of "
                           "the sequence only: give the targets (labels=, or (input_ids, targets)) and let the engine "
                           "compute the loss, or train your own loss as an objective on exact per-token log-probs "
                           "(the `objective` section, docs/objectives.md), which is exact under every split")
        out = self.parallel.spec.call(self.parallel.module, batch)
        vocab = vocab_parallel_loss(self.parallel)
        if vocab is None or not isinstance(out, torch.Tensor) or out.shape[-1] != vocab.local_vocab:
            return out
        return gather_from_region(out, vocab.axis, dim=-1, tag="logits")[..., :vocab.vocab_size]

    def run(self, batch) -> torch.Tensor:
        """A loader's micro-batch through the model: its loss, or a model's (sum, count)."""
        (self.check_train if self.parallel.module.training else self.check_eval)(batch)
        inputs, kwargs = ((), batch) if isinstance(batch, dict) else \
            (tuple(batch), {}) if isinstance(batch, (tuple, list)) else ((batch,), {})
        token = as_micro_batch(inputs, kwargs)  # from the loader's tensors, before the copy (token_layout's note)
        if token is not None:
            out = self(token.to(self.device), (), {})
        else:
            inputs, kwargs = to_device((inputs, kwargs), self.device)
            out = self(None, inputs, kwargs)
        return out if split_loss(out) is not None else loss_of_output(out)

    def pipeline_batch(self, batch):
        """A pipeline micro-batch: token data in its normal form (transformers' dicts too), else the pair."""
        (self.check_train if self.parallel.module.training else self.check_eval)(batch)
        # token data in its normal form from the loader's tensors, before the copy (data/token_layout.py's note)
        token = as_micro_batch((), batch) if isinstance(batch, dict) else \
            as_micro_batch(tuple(batch), {}) if isinstance(batch, (tuple, list)) else None
        if token is None and isinstance(batch, dict):
            raise InvalidValueError(f"a pipeline micro-batch dict must be token data (input_ids with labels or "
                                    f"targets, optionally attention_mask, position_ids, cu_seq_lens_q), got keys "
                                    f"{sorted(batch)}")
        return to_device(batch, self.device) if token is None else token.to(self.device)

    def check_agreement(self, batches: list) -> None:
        """The peers of this replica hold the same micro-batches (`data/agreement.py`): first steps, or always."""
        mode, steps = self.batch_agreement, self.train_state.global_steps
        if mode == "every_step" or (mode == "first_steps" and steps < FIRST_STEPS):
            check_same_batches(batches, self.mesh, steps + 1, self.device)

    @contextmanager
    def own_evaluation_checker(self):
        """A dataset's micro-batches are compared with its own first one, not with another dataset's."""
        kept, self.check_eval = self.check_eval, BatchChecker(self.batch_check, "evaluation")
        try:
            yield
        finally:
            self.check_eval = kept


def vocab_parallel_loss(parallel) -> VocabParallelCrossEntropy | None:
    """The vocab-parallel loss when the head's logits stay split over tp (it knows the vocabulary's size)."""
    pipeline = parallel.pipeline
    modules = [*parallel.module.modules(), *([pipeline.loss_fn] if pipeline is not None else [])]
    return next((m for m in modules if isinstance(m, VocabParallelCrossEntropy)), None)

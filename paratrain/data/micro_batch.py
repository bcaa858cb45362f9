"""One typed micro-batch of token data: what every strategy reads, whatever form the user fed.

    batch = as_micro_batch((), {"input_ids": ids, "labels": ids, "attention_mask": mask})   # transformers' form
    batch = as_micro_batch((ids, targets), {})          # paratrain's form: targets already shifted
    batch.input_ids, batch.targets, batch.position_ids, batch.documents, batch.valid_tokens()

[Note: one normal form]
Token ids, targets, positions and documents travel together from the loader through the sequence split
(context parallelism), the pipeline hand-over and the attention cores to the loss, so no strategy reads a
model's argument names. The normal form is:
  targets    (b, s): the token each position predicts, already shifted (transformers' `labels` are shifted
             here, once, before any split), IGNORE where a position predicts nothing: the last token of a row
             or of a document, padding, and whatever the user masked (prompts);
  positions  (b, s) or None for arange(s) in every row: a padded row's real tokens take the positions they
             would have alone (left padding), a packed document starts at 0;
  documents  whole-row document ids (`paratrain.attention.Documents`, -1 for padding) or None when every row
             is one document whose real tokens attend nothing but their own past (no padding, or right
             padding only: a real token never looks right).
So a padded row trains exactly as its real tokens alone, and a packed row as its documents one by one.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from paratrain.attention import Documents
from paratrain.data.host import host_reads, on_host
from paratrain.data.objective_batch import objective_form, objective_parts
from paratrain.data.token_layout import IGNORE, MicroBatchError, describe, is_token_tensor, refuse_if, with_layout
from paratrain.errors import InvalidValueError

KNOWN_KEYS = ("input_ids", "labels", "targets", "attention_mask", "position_ids", "document_ids",
              "cu_seq_lens_q", "cu_seqlens")
__all__ = ["IGNORE", "KNOWN_KEYS", "MicroBatch", "MicroBatchError", "add_to_loss", "as_micro_batch", "batch_in_flight",
           "in_flight", "loss_of_output", "objective_micro_batch", "split_loss"]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (b, s)
    targets: torch.Tensor | None = None  # (b, s), shifted; IGNORE where nothing is predicted
    position_ids: torch.Tensor | None = None  # (b, s), or (s,) shared by every row; None: arange(s)
    documents: Documents | None = None  # whole rows; None: one document per row
    labels_form: bool = False  # given as transformers' `labels`: the caller expects an output with `.loss`
    labels: torch.Tensor | None = None  # those labels as given (unshifted), for a model that shifts them itself
    # What an objective needs beyond the targets (`paratrain.data.objective_batch`): per-row values (b, ...), kept
    # whole by every split, and per-target values (b, s), aligned with `targets` and split like them.
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    form: str = "tokens"  # "tokens", "preference" (chosen rows, then rejected) or "completions" (GRPO's)

    def valid_tokens(self) -> torch.Tensor:
        """The number of positions with a target (an int64 scalar on the batch's device; no host sync)."""
        if self.targets is None:
            return torch.zeros((), dtype=torch.int64, device=self.input_ids.device)
        return (self.targets != IGNORE).sum()

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), targets=move(self.targets),
                       position_ids=move(self.position_ids), labels=move(self.labels),
                       documents=None if self.documents is None else self.documents.to(device),
                       rows={k: move(v) for k, v in self.rows.items()},
                       tokens={k: move(v) for k, v in self.tokens.items()})

    def positions(self) -> torch.Tensor:
        """(b, s) positions, arange where none were given."""
        if self.position_ids is not None:
            return self.position_ids
        b, s = self.input_ids.shape
        return torch.arange(s, device=self.input_ids.device).expand(b, s)

    def map_tokens(self, fn) -> MicroBatch:
        """`fn` applied to every (b, s) per-token tensor (ids, targets, positions; the documents stay whole):
        the context-parallel split. Positions are made explicit first, since the split changes which they are
        (one row of them, (s',), when every row has arange(s))."""
        if self.position_ids is not None:
            positions = fn(self.position_ids)
        else:
            positions = fn(torch.arange(self.input_ids.shape[1], device=self.input_ids.device).unsqueeze(0))[0]
        return replace(self, input_ids=fn(self.input_ids),
                       targets=None if self.targets is None else fn(self.targets),
                       position_ids=positions, labels=None, tokens={k: fn(v) for k, v in self.tokens.items()})


def as_micro_batch(args: tuple, kwargs: dict) -> MicroBatch | None:
    """The normal form of a call `(*args, **kwargs)` or a loader's micro-batch (a tuple: args; a dict: kwargs),
    or None when it is not token data (then it goes to the model unchanged, as before). Tensors in host memory
    are checked and their layout read there (`token_layout`'s note); tensors on an accelerator are not read."""
    if not args and objective_form(kwargs) is not None:  # TRL's collated preference or GRPO micro-batches
        return objective_micro_batch(kwargs)
    if len(args) > 2 or any(k not in KNOWN_KEYS for k in kwargs):
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    if not is_token_tensor(ids) or (args and "input_ids" in kwargs):
        return None
    targets = args[1] if len(args) == 2 else kwargs.get("targets")
    labels = kwargs.get("labels")
    if targets is not None and not (is_token_tensor(targets) and targets.shape == ids.shape):
        return None  # e.g. one class per row: not a language-model batch
    if targets is not None and labels is not None:
        raise MicroBatchError("a micro-batch with both `targets` (already shifted) and `labels` (shifted inside): "
                              "give one of them")
    if labels is not None and not (is_token_tensor(labels) and labels.shape == ids.shape):
        raise MicroBatchError(f"`labels` must be an integer tensor shaped like input_ids {tuple(ids.shape)}, "
                              f"got {describe(labels)}")
    host = on_host(ids, targets, labels, *(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
    with host_reads() if host else nullcontext():
        if targets is not None and targets.numel():
            # a row of one repeated token ("----", real text has them) is its own shift: not a sign of unshifted
            # targets, so only rows with two different tokens can show it
            refuse_if((targets == ids).all() & (ids != ids[..., :1]).any(), host, lambda: _unshifted(ids))
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # position t predicts token t + 1
        batch = MicroBatch(ids, targets, labels_form=labels is not None, labels=labels)
        return with_layout(batch, kwargs, host)


_IN_FLIGHT: ContextVar[MicroBatch | None] = ContextVar("paratrain_micro_batch_in_flight", default=None)


@contextmanager
def in_flight(batch: MicroBatch | None):
    """`batch` is the micro-batch whose loss is computed inside: an objective reads its other fields
    (`batch_in_flight`) where the model hands its loss module only the logits and the targets."""
    token = _IN_FLIGHT.set(batch)
    try:
        yield
    finally:
        _IN_FLIGHT.reset(token)


def batch_in_flight() -> MicroBatch | None:
    return _IN_FLIGHT.get()


def objective_micro_batch(kwargs: dict) -> MicroBatch:
    """TRL's collated preference or GRPO micro-batch in the normal form (`paratrain.data.objective_batch`)."""
    parts = objective_parts(kwargs)
    host = on_host(*(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
    with host_reads() if host else nullcontext():
        batch = MicroBatch(parts.input_ids, parts.targets, rows=parts.rows, tokens=parts.tokens, form=parts.form)
        return with_layout(batch, {"attention_mask": parts.attention_mask}, host)


def _unshifted(ids: torch.Tensor) -> str:
    return (f"the targets equal the inputs token for token (shape {tuple(ids.shape)}): paratrain's (inputs, "
            f"targets) form takes targets already shifted (targets[:, t] = inputs[:, t + 1]), so this would train "
            f"the model to copy its input. Shift them, or pass a dict with transformers' `labels` (shifted "
            f"inside, once, before any split)")


def split_loss(output) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A forward's or loss function's `(sum, count)` (two scalar tensors), or None for any other output."""
    if isinstance(output, (tuple, list)) and len(output) == 2 and all(
            isinstance(t, torch.Tensor) and t.dim() == 0 for t in output):
        return output[0], output[1]
    return None


def add_to_loss(loss, extra: torch.Tensor):
    """`loss` plus a term that is itself a mean (an MoE's router losses): added to a scalar loss, or to a
    (sum, count) pair's sum as `extra` per unit of its count, so the step's division keeps it a mean."""
    parts = split_loss(loss)
    if parts is None:
        return loss + extra
    total, count = parts
    return total + extra * count.to(total.dtype), count


def loss_of_output(output) -> torch.Tensor:
    """The loss a forward returned: the tensor itself, or the `loss` of a transformers output (`labels=`)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise InvalidValueError(f"train_batch: the model's forward returned {type(output).__name__} without a "
                                f"loss; return the loss tensor, or an output with .loss (pass labels=)")
    return loss

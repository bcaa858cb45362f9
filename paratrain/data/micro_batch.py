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

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from paratrain.attention import PADDING, Documents
from paratrain.errors import Error, InvalidValueError

IGNORE = -100  # the target of a position that predicts nothing (torch's and transformers' ignore_index)
KNOWN_KEYS = ("input_ids", "labels", "targets", "attention_mask", "position_ids", "document_ids",
              "cu_seq_lens_q", "cu_seqlens")


class MicroBatchError(Error, ValueError):
    """Token data whose form paratrain cannot train exactly (a mask that is not padding, unshifted targets)."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (b, s)
    targets: torch.Tensor | None = None  # (b, s), shifted; IGNORE where nothing is predicted
    position_ids: torch.Tensor | None = None  # (b, s), or (s,) shared by every row; None: arange(s)
    documents: Documents | None = None  # whole rows; None: one document per row
    labels_form: bool = False  # given as transformers' `labels`: the caller expects an output with `.loss`
    labels: torch.Tensor | None = None  # those labels as given (unshifted), for a model that shifts them itself

    def valid_tokens(self) -> torch.Tensor:
        """The number of positions with a target (an int64 scalar on the batch's device; no host sync)."""
        if self.targets is None:
            return torch.zeros((), dtype=torch.int64, device=self.input_ids.device)
        return (self.targets != IGNORE).sum()

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), targets=move(self.targets),
                       position_ids=move(self.position_ids), labels=move(self.labels),
                       documents=None if self.documents is None else self.documents.to(device))

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
                       position_ids=positions, labels=None)


def as_micro_batch(args: tuple, kwargs: dict) -> MicroBatch | None:
    """The normal form of a call `(*args, **kwargs)` or a loader's micro-batch (a tuple: args; a dict: kwargs),
    or None when it is not token data (then it goes to the model unchanged, as before)."""
    if len(args) > 2 or any(k not in KNOWN_KEYS for k in kwargs):
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    if not _is_token_tensor(ids) or (args and "input_ids" in kwargs):
        return None
    targets = args[1] if len(args) == 2 else kwargs.get("targets")
    labels = kwargs.get("labels")
    if targets is not None and not (_is_token_tensor(targets) and targets.shape == ids.shape):
        return None  # e.g. one class per row: not a language-model batch
    if targets is not None and labels is not None:
        raise MicroBatchError("a micro-batch with both `targets` (already shifted) and `labels` (shifted inside): "
                              "give one of them")
    if targets is not None and targets.numel() and torch.equal(targets, ids):
        raise MicroBatchError(
            f"the targets equal the inputs token for token (shape {tuple(ids.shape)}): paratrain's (inputs, "
            f"targets) form takes targets already shifted (targets[:, t] = inputs[:, t + 1]), so this would train "
            f"the model to copy its input. Shift them, or pass a dict with transformers' `labels` (shifted "
            f"inside, once, before any split)")
    if labels is not None:
        if not (_is_token_tensor(labels) and labels.shape == ids.shape):
            raise MicroBatchError(f"`labels` must be an integer tensor shaped like input_ids {tuple(ids.shape)}, "
                                  f"got {_describe(labels)}")
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # position t predicts token t + 1
    batch = MicroBatch(ids, targets, labels_form=labels is not None, labels=labels)
    return _with_layout(batch, kwargs)


def _with_layout(batch: MicroBatch, kwargs: dict) -> MicroBatch:
    """Positions, documents and the targets they mask, from attention_mask / position_ids / cu_seq_lens /
    document_ids."""
    ids = batch.input_ids
    positions = _positions_arg(kwargs.get("position_ids"), ids)
    docs = _document_ids(kwargs, positions, ids)
    real = _real_tokens(kwargs.get("attention_mask"), ids)
    left_padded = False
    if real is not None:
        left_padded = bool((~real[:, 0] & real.any(dim=1)).any())
        if positions is None and left_padded:  # real tokens count from 0, as they would alone
            positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        if docs is not None or left_padded:
            base = docs if docs is not None else torch.zeros_like(ids)
            docs = torch.where(real, base, torch.full_like(base, PADDING))
    targets = batch.targets
    if targets is not None:
        targets = _mask_targets(targets, docs, real)
    return replace(batch, targets=targets, position_ids=positions,
                   documents=Documents(docs) if docs is not None else None)


def _mask_targets(targets: torch.Tensor, docs: torch.Tensor | None, real: torch.Tensor | None) -> torch.Tensor:
    """No target on padding, and none that crosses into the next document or into padding."""
    keep = torch.ones_like(targets, dtype=torch.bool)
    if real is not None:
        keep &= real
        keep[:, :-1] &= real[:, 1:]
    if docs is not None:
        keep[:, :-1] &= docs[:, 1:] == docs[:, :-1]
    return targets.masked_fill(~keep, IGNORE)  # unconditionally: asking whether any is masked reads the device


def _positions_arg(positions, ids: torch.Tensor) -> torch.Tensor | None:
    if positions is None:
        return None
    if not _is_token_tensor(positions, dims=(1, 2)) or positions.shape[-1] != ids.shape[1]:
        raise MicroBatchError(f"`position_ids` must be integers of shape {tuple(ids.shape)} or ({ids.shape[1]},), "
                              f"got {_describe(positions)}")
    return positions.expand(ids.shape) if positions.dim() == 1 else positions


def _document_ids(kwargs: dict, positions: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
    """(b, s) document ids from explicit ids, boundaries (cu_seq_lens: one flattened row) or position resets
    (a document starts where its position is 0); None when every row is one document."""
    explicit = kwargs.get("document_ids")
    bounds = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    if explicit is not None:
        if not (_is_token_tensor(explicit) and explicit.shape == ids.shape):
            raise MicroBatchError(f"`document_ids` must be integers shaped like input_ids {tuple(ids.shape)}, got "
                                  f"{_describe(explicit)}")
        return explicit
    if bounds is not None:
        return _from_boundaries(bounds, ids)
    if positions is None:
        return None
    starts = positions == 0
    starts[:, 0] = True
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(dim=1) - 1


def _from_boundaries(bounds, ids: torch.Tensor) -> torch.Tensor:
    b, s = ids.shape
    ok = _is_token_tensor(bounds, dims=(1,)) and b == 1 and bounds.numel() >= 2 and int(bounds[0]) == 0 \
        and int(bounds[-1]) == s and bool((bounds[1:] >= bounds[:-1]).all())
    if not ok:
        raise MicroBatchError(f"`cu_seq_lens` must be the increasing document boundaries [0, ..., {s}] of one "
                              f"flattened row (input_ids of shape (1, {s})), got {_describe(bounds)} for input_ids "
                              f"{tuple(ids.shape)}")
    index = torch.arange(s, device=ids.device)
    return (torch.bucketize(index, bounds[1:].to(ids.device), right=True)).unsqueeze(0)


def _real_tokens(mask, ids: torch.Tensor) -> torch.Tensor | None:
    """The attention_mask as (b, s) bool, checked to be right or left padding; None when it masks nothing."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise MicroBatchError(f"`attention_mask` must be a (b, s) tensor of 0/1 shaped like input_ids "
                              f"{tuple(ids.shape)}, got {_describe(mask)}; 4-d masks are not accepted: give "
                              f"padding as a 2-d mask and packed documents by position_ids or cu_seq_lens")
    real = mask.bool()
    if bool(real.all()):
        return None
    count = real.sum(dim=1)
    s = ids.shape[1]
    index = torch.arange(s, device=real.device)
    first = torch.where(real, index, s).min(dim=1).values
    last = torch.where(real, index, -1).max(dim=1).values
    padding = (count > 0) & ((last - first + 1 != count) | ((first != 0) & (last != s - 1)))
    if bool(padding.any()):
        row = int(padding.nonzero()[0, 0])
        runs = _runs(real[row].tolist())
        raise MicroBatchError(f"attention_mask row {row} is neither right- nor left-padding: its real tokens are at "
                              f"positions {runs} of {s}. paratrain trains rows padded on one side, or packed "
                              f"documents given by position_ids (restarting at 0) or cu_seq_lens with no padding "
                              f"between them; fix the collator")
    return real


def _runs(flags: list[bool]) -> str:
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append(f"{start}..{i - 1}")
            start = None
    return ", ".join(runs)


def _is_token_tensor(value, dims=(2,)) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() in dims and not value.dtype.is_floating_point \
        and not value.dtype.is_complex and value.dtype != torch.bool


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def split_loss(output) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A forward's or loss function's `(sum, count)` (two scalar tensors), or None for any other output."""
    if isinstance(output, (tuple, list)) and len(output) == 2 and all(
            isinstance(t, torch.Tensor) and t.dim() == 0 for t in output):
        return output[0], output[1]
    return None


def loss_of_output(output) -> torch.Tensor:
    """The loss a forward returned: the tensor itself, or the `loss` of a transformers output (`labels=`)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise InvalidValueError(f"train_batch: the model's forward returned {type(output).__name__} without a "
                                f"loss; return the loss tensor, or an output with .loss (pass labels=)")
    return loss

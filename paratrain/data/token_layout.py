"""Positions, documents and the targets they mask, from a micro-batch's `attention_mask`, `position_ids`,
`cu_seq_lens` or `document_ids` (the layout half of `paratrain.data.micro_batch`'s normal form).

[Note: read on the host, never on the device]
Checking the layout (one-sided padding, increasing boundaries) and choosing its simplest form (no documents when
no row is split, no positions when no row is left-padded) reads the values. The engine builds the micro-batch
from the loader's tensors while they are still in host memory (`host=True`): those reads cost no device sync,
and the documents' runs, which the attention kernels are chosen by, are read there too, once. Tensors already on
an accelerator (a user's `engine(x, y)` after `x.to(device)`) take the general form instead and are checked by
device-side asserts (`host=False`): nothing is read, and the runs are read where attention first needs them.
Both forms train the same objective.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from paratrain.attention import PADDING, Documents
from paratrain.errors import Error

IGNORE = -100  # the target of a position that predicts nothing (torch's and transformers' ignore_index)


class MicroBatchError(Error, ValueError):
    """Token data whose form paratrain cannot train exactly (a mask that is not padding, unshifted targets)."""


def refuse_if(bad: torch.Tensor, host: bool, message) -> None:
    """Raise MicroBatchError(message()) where the bool scalar `bad` is true: read at once from host memory, or
    asserted on the device without a read (an accelerator stops at its next sync with the message)."""
    if host:
        if bool(bad):
            raise MicroBatchError(message())
    else:
        torch._assert_async(~bad, f"paratrain micro-batch: {message()}")


def with_layout(batch, kwargs: dict, host: bool):
    """`batch` (a MicroBatch of ids and targets) with positions, documents and the targets they mask. `host`:
    the caller checked that the tensors are in host memory and declared its reads (`host_reads`)."""
    ids = batch.input_ids
    positions = _positions_arg(kwargs.get("position_ids"), ids)
    docs = _document_ids(kwargs, positions, ids, host)
    real = _real_tokens(kwargs.get("attention_mask"), ids, host)
    if real is not None:
        left_padded = bool((~real[:, 0] & real.any(dim=1)).any()) if host else True
        if positions is None and left_padded:  # real tokens count from 0, as they would alone
            positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        if docs is not None or left_padded:
            base = docs if docs is not None else torch.zeros_like(ids)
            docs = torch.where(real, base, torch.full_like(base, PADDING))
    targets = batch.targets
    if targets is not None:
        targets = _mask_targets(targets, docs, real)
    documents = Documents(docs) if docs is not None else None
    if documents is not None and host:
        documents.runs()  # read here, from host memory: kept when the micro-batch moves to the device
    return replace(batch, targets=targets, position_ids=positions, documents=documents)


def _mask_targets(targets: torch.Tensor, docs: torch.Tensor | None, real: torch.Tensor | None) -> torch.Tensor:
    """No target on padding, and none that crosses into the next document or into padding."""
    keep = torch.ones_like(targets, dtype=torch.bool)
    if real is not None:
        keep &= real
        keep[:, :-1] &= real[:, 1:]
    if docs is not None:
        keep[:, :-1] &= docs[:, 1:] == docs[:, :-1]
    return targets.masked_fill(~keep, IGNORE)  # unconditionally: asking whether any is masked reads the values


def _positions_arg(positions, ids: torch.Tensor) -> torch.Tensor | None:
    if positions is None:
        return None
    if not is_token_tensor(positions, dims=(1, 2)) or positions.shape[-1] != ids.shape[1]:
        raise MicroBatchError(f"`position_ids` must be integers of shape {tuple(ids.shape)} or ({ids.shape[1]},), "
                              f"got {describe(positions)}")
    return positions.expand(ids.shape) if positions.dim() == 1 else positions


def _document_ids(kwargs: dict, positions: torch.Tensor | None, ids: torch.Tensor, host: bool) -> torch.Tensor | None:
    """(b, s) document ids from explicit ids, boundaries (cu_seq_lens: one flattened row) or position resets
    (a document starts where its position is 0); None when every row is one document (known on the host only)."""
    explicit = kwargs.get("document_ids")
    bounds = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    if explicit is not None:
        if not (is_token_tensor(explicit) and explicit.shape == ids.shape):
            raise MicroBatchError(f"`document_ids` must be integers shaped like input_ids {tuple(ids.shape)}, got "
                                  f"{describe(explicit)}")
        return explicit
    if bounds is not None:
        return _from_boundaries(bounds, ids, host)
    if positions is None:
        return None
    starts = positions == 0
    starts[:, 0] = True
    if host and not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(dim=1) - 1


def _from_boundaries(bounds, ids: torch.Tensor, host: bool) -> torch.Tensor:
    b, s = ids.shape

    def message() -> str:
        return (f"`cu_seq_lens` must be the increasing document boundaries [0, ..., {s}] of one flattened row "
                f"(input_ids of shape (1, {s})), got {describe(bounds)} for input_ids {tuple(ids.shape)}")

    if not (is_token_tensor(bounds, dims=(1,)) and b == 1 and bounds.numel() >= 2):
        raise MicroBatchError(message())
    refuse_if((bounds[0] != 0) | (bounds[-1] != s) | (bounds[1:] < bounds[:-1]).any(), host, message)
    index = torch.arange(s, device=ids.device)
    return (torch.bucketize(index, bounds[1:].to(ids.device), right=True)).unsqueeze(0)


def _real_tokens(mask, ids: torch.Tensor, host: bool) -> torch.Tensor | None:
    """The attention_mask as (b, s) bool, checked to hold one run of real tokens per row (padding on the left, the
    right or both: a GRPO row is a left-padded prompt and a right-padded completion); None when it masks nothing
    (known on the host only)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise MicroBatchError(f"`attention_mask` must be a (b, s) tensor of 0/1 shaped like input_ids "
                              f"{tuple(ids.shape)}, got {describe(mask)}; 4-d masks are not accepted: give "
                              f"padding as a 2-d mask and packed documents by position_ids or cu_seq_lens")
    real = mask.bool()
    if host and bool(real.all()):
        return None
    count = real.sum(dim=1)
    s = ids.shape[1]
    index = torch.arange(s, device=real.device)
    first = torch.where(real, index, s).min(dim=1).values
    last = torch.where(real, index, -1).max(dim=1).values
    padding = (count > 0) & (last - first + 1 != count)

    def message() -> str:
        fix = ("paratrain trains rows whose real tokens are one run (padding before and after it), or packed "
               "documents given by position_ids (restarting at 0) or cu_seq_lens with no padding between them; "
               "fix the collator")
        if not host:
            return f"an attention_mask row has padding between its real tokens: {fix}"
        row = int(padding.nonzero()[0, 0])
        return (f"attention_mask row {row} has padding between its real tokens: they are at positions "
                f"{_runs(real[row].tolist())} of {s}. {fix}")

    refuse_if(padding.any(), host, message)
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


def is_token_tensor(value, dims=(2,)) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() in dims and not value.dtype.is_floating_point \
        and not value.dtype.is_complex and value.dtype != torch.bool


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"

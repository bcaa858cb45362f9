"""Documents into rows: packed back to back (best fit), or one per row padded to the longest of its batch.

    rows = pack(lengths, row_len)          # [[doc indices of row 0], [..of row 1], ...]: every doc once
    batch = packed_batch(docs, rows[:8], row_len)       # input_ids, labels, position_ids, attention_mask
    batch = padded_batch(docs[:8])                      # input_ids, labels, attention_mask (right padding)

Both give transformers' form (`labels` unshifted, -100 where nothing is learned), which the engine brings to
its normal form (`micro_batch.py`): a packed row's `position_ids` restart at 0 for each document, so attention
and targets stay inside documents; its tail, when the documents do not fill it, is padding.

[Note: best fit]
Each document goes into the open row whose free space it fills best (the least space left over), or opens a
new row: the classic best-fit bin packing, O(n log n) with the free spaces kept sorted. It keeps the
documents' order within a row and wastes little (rows end up nearly full when documents are short against the
row). A document longer than the row is cut into row-sized pieces first (each piece its own document).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from paratrain.errors import InvalidValueError


def pieces(lengths: Sequence[int], row_len: int) -> list[tuple[int, int, int]]:
    """(document, start, length) pieces of at most `row_len` tokens, every token of every document once."""
    if row_len < 1:
        raise InvalidValueError(f"rows must hold at least one token, got row_len {row_len}")
    out = []
    for doc, n in enumerate(lengths):
        out += [(doc, start, min(row_len, n - start)) for start in range(0, n, row_len)]
    return out


def pack(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Best-fit packing (see the note) of documents of `lengths` (each at most `row_len`): per row, the indices
    of its documents in order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, row), sorted
    for doc, n in enumerate(lengths):
        if not 0 < n <= row_len:
            raise InvalidValueError(f"document {doc} has {n} tokens; pack() takes 1..{row_len} (cut longer ones "
                                    f"with pieces())")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, row = free.pop(at)
            rows[row].append(doc)
            if space > n:
                bisect.insort(free, (space - n, row))
        else:
            rows.append([doc])
            if row_len > n:
                bisect.insort(free, (row_len - n, len(rows) - 1))
    return rows


def packed_batch(docs: Sequence[torch.Tensor], rows: Sequence[Sequence[int]], row_len: int, pad_id: int = 0,
                 labels: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The rows `rows` (document indices into `docs`) as one micro-batch of (len(rows), row_len). `labels`: each
    document's own (unshifted, -100 where nothing is learned: a masked prompt); by default its ids."""
    ids = torch.full((len(rows), row_len), pad_id, dtype=torch.long)
    out_labels = torch.full_like(ids, -100)
    positions = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        at = 0
        for doc in row:
            n = docs[doc].numel()
            ids[r, at:at + n] = docs[doc]
            out_labels[r, at:at + n] = docs[doc] if labels is None else _labels_of(labels, docs, doc)
            positions[r, at:at + n] = torch.arange(n)
            mask[r, at:at + n] = 1
            at += n
    return {"input_ids": ids, "labels": out_labels, "position_ids": positions, "attention_mask": mask}


def padded_batch(docs: Sequence[torch.Tensor], pad_id: int = 0, length: int | None = None,
                 labels: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One document per row, right-padded to the longest (transformers' DataCollatorWithPadding), or to
    `length` (padding="max_length"); `labels` as in packed_batch."""
    longest = length if length is not None else max(d.numel() for d in docs)
    ids = torch.full((len(docs), longest), pad_id, dtype=torch.long)
    out_labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, doc in enumerate(docs):
        ids[r, :doc.numel()] = doc
        out_labels[r, :doc.numel()] = doc if labels is None else _labels_of(labels, docs, r)
        mask[r, :doc.numel()] = 1
    return {"input_ids": ids, "labels": out_labels, "attention_mask": mask}


def _labels_of(labels: Sequence[torch.Tensor], docs: Sequence[torch.Tensor], doc: int) -> torch.Tensor:
    if labels[doc].shape != docs[doc].shape:
        raise InvalidValueError(f"document {doc}: labels of shape {tuple(labels[doc].shape)} for ids of shape "
                                f"{tuple(docs[doc].shape)}; give one label per token")
    return labels[doc]

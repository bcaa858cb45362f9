"""Data shaped like real fine-tuning data, and the one-process reference that runs it the plain way.

Four kinds of rows, all of `seq_len` tokens, in transformers' form (`labels` unshifted, shifted once inside):
  masked   a prompt of 1..seq_len-2 tokens whose labels are -100, then the completion
  right    1..seq_len real tokens, then padding (attention_mask 0, labels -100)
  left     padding, then 1..seq_len real tokens
  packed   documents of 1..seq_len tokens back to back, position_ids restarting at 0 for each, the first label
           of each document -100 (transformers' DataCollatorWithFlattening)
The reference runs every document (a packed row's documents, a padded row's real tokens, a masked row whole)
alone, through the model's own forward, and divides the sum of its token losses by the number of targets:
the objective one process trains on, with nothing shared between documents and no padding at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from paratrain.data import load_corpus

KINDS = ("masked", "right", "left", "packed")
PAD = 0


def _lengths(g: torch.Generator, total: int, low: int = 1) -> list[int]:
    """Random document lengths (at least `low`) that fill `total` exactly."""
    out = []
    while total > 0:
        n = min(total, int(torch.randint(low, max(low + 1, total // 2 + 2), (1,), generator=g)))
        out.append(n)
        total -= n
    return out


def make_row(kind: str, tokens: torch.Tensor, seq_len: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = tokens[:seq_len].clone()
    if kind == "masked":
        labels = ids.clone()
        labels[:int(torch.randint(1, seq_len - 1, (1,), generator=g))] = -100
        return {"input_ids": ids, "labels": labels}
    if kind in ("right", "left"):
        real = int(torch.randint(1, seq_len + 1, (1,), generator=g))
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[:real] = 1
        if kind == "left":
            mask = mask.flip(0)
        ids = ids.masked_fill(mask == 0, PAD)
        return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}
    if kind == "packed":
        lengths = _lengths(g, seq_len)
        positions = torch.cat([torch.arange(n) for n in lengths])
        labels = ids.clone()
        labels[positions == 0] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
    raise ValueError(kind)


class RealRows(Dataset):
    """`count` rows of one kind cut from the embedded corpus (deterministic)."""

    def __init__(self, kind: str, seq_len: int = 16, count: int = 64, seed: int = 0):
        train, _ = load_corpus()
        g = torch.Generator().manual_seed(seed)
        self.rows = [make_row(kind, train[i * seq_len:(i + 1) * seq_len], seq_len, g) for i in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def documents(row: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) of each document of one row, padding removed."""
    ids, labels = row["input_ids"], row["labels"]
    if "attention_mask" in row:
        real = row["attention_mask"].bool()
        return [(ids[real], labels[real])] if real.any() else []
    if "position_ids" in row:
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [ids.numel()]
        return [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]
    return [(ids, labels)]


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids) if hasattr(model, "get_output_embeddings") else model(ids)
    return out.logits if hasattr(out, "logits") else out


def documents_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference objective over a global batch: each document alone, sum of token losses / targets."""
    total, count = 0.0, 0
    for i in range(batch["input_ids"].shape[0]):
        row = {k: v[i] for k, v in batch.items()}
        for ids, labels in documents(row):
            targets = F.pad(labels[1:], (0, 1), value=-100)
            logits = logits_of(model, ids.unsqueeze(0))[0]
            total = total + F.cross_entropy(logits.float(), targets, reduction="sum")
            count += int((targets != -100).sum())
    return total / max(count, 1)


def micro_batch_mean_loss(model, batch: dict[str, torch.Tensor], micro: int) -> torch.Tensor:
    """DeepSpeed's objective: the mean over micro-batches of `micro` rows of each one's token mean."""
    rows = batch["input_ids"].shape[0]
    parts = [documents_loss(model, {k: v[i:i + micro] for k, v in batch.items()}) for i in range(0, rows, micro)]
    return torch.stack(parts).mean()

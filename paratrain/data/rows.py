"""Tokenized examples as training rows: each row one sample that the data-parallel sampler deals out like any
other, so a fine-tuning job's data position, resharding and sample order are the sampler's (`datasets.py`).

    rows = Rows(examples, seq_len=512, packing=True, pad_id=0)
    rows[i]    # {"input_ids", "labels", "position_ids", "attention_mask"}: tensors of seq_len

Packed rows hold several documents back to back (best fit, `packing.pack`), their `position_ids` restarting at
0 for each; padded rows hold one document each, padded to seq_len. Both are transformers' form (labels
unshifted, -100 where nothing is learned, attention_mask 0 on padding), which the engine brings to its normal
form: attention and targets stay inside each document, padding is neither attended nor trained. Every row has
seq_len tokens, so every layout (pipelines and context parallelism included) gets the shapes it expects; the
rows are built once, from the examples in file order, so they are the same in every layout and on resume.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from paratrain.data.formats import Example
from paratrain.data.packing import pack, packed_batch
from paratrain.errors import InvalidValueError


class Rows(Dataset):
    """Rows of `seq_len` tokens from `examples` (each at most seq_len: `tokenize_records` cuts longer ones)."""

    def __init__(self, examples: Sequence[Example], seq_len: int, packing: bool, pad_id: int):
        if not examples:
            raise InvalidValueError("no examples to build rows from: the dataset is empty after tokenization")
        lengths = [len(e.input_ids) for e in examples]
        longest = max(lengths)
        if longest > seq_len:
            raise InvalidValueError(f"an example has {longest} tokens, more than seq_len {seq_len}; cut examples "
                                    f"with tokenize_records(..., seq_len=seq_len)")
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.ids = [torch.tensor(e.input_ids, dtype=torch.long) for e in examples]
        self.labels = [torch.tensor(e.labels, dtype=torch.long) for e in examples]
        self.sources = [e.source for e in examples]
        self.rows = pack(lengths, seq_len) if packing else [[i] for i in range(len(examples))]
        self.real_tokens = [sum(lengths[d] for d in row) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        batch = packed_batch(self.ids, [self.rows[i]], self.seq_len, self.pad_id, labels=self.labels)
        return {key: value[0] for key, value in batch.items()}

    def padding_fraction(self, indices: Sequence[int]) -> float:
        """The share of the rows' positions that are padding."""
        return 1.0 - sum(self.real_tokens[i] for i in indices) / (len(indices) * self.seq_len)

"""The `data` section's files as training and validation rows: what `paratrain train` trains a fine-tuning job
on (docs/data.md).

    data = job_data(cfg.data, tokenizer, seq_len=512, vocab_size=32000)
    data.train[i]          # a row: {"input_ids", "labels", "position_ids", "attention_mask"} of seq_len
    data.summary           # what reading and tokenizing did, every record counted

Every rank reads and tokenizes the same files the same way, so a bad file stops every rank with the same
error before any collective, and the rows (and so the sample order the sampler deals) are the same in every
layout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from paratrain.config.data import DataConfig
from paratrain.config.errors import ConfigError
from paratrain.data.formats import DataSummary, tokenize_records
from paratrain.data.rows import Rows
from paratrain.data.sources import iter_records


@dataclass
class JobData:
    train: Rows
    validation: Rows | None
    summary: dict  # {"train": DataSummary fields, "validation": ..., "rows": ..., "padding_fraction": ...}


def job_data(cfg: DataConfig, tokenizer, seq_len: int, vocab_size: int) -> JobData:
    """Read, tokenize and lay out `cfg.train` (and `cfg.validation`) in rows of `seq_len` tokens."""
    _check_vocabulary(tokenizer, vocab_size)
    pad_id = _pad_id(tokenizer)
    train, train_summary = _rows(cfg, cfg.train, tokenizer, seq_len, pad_id, cfg.max_samples)
    validation, val_summary = (_rows(cfg, cfg.validation, tokenizer, seq_len, pad_id, None)
                               if cfg.validation else (None, None))
    summary = {"train": vars(train_summary), "train_rows": len(train),
               "train_padding_fraction": train.padding_fraction(range(len(train)))}
    if validation is not None:
        summary |= {"validation": vars(val_summary), "validation_rows": len(validation)}
    return JobData(train, validation, summary)


def _rows(cfg: DataConfig, path: str, tokenizer, seq_len: int, pad_id: int,
          limit: int | None) -> tuple[Rows, DataSummary]:
    records = iter_records(path, text_sample_by=cfg.text_sample_by)
    if limit is not None:
        records = itertools.islice(records, limit)
    examples, summary = tokenize_records(records, cfg.format, tokenizer, fields=cfg.fields or None, seq_len=seq_len,
                                         overflow=cfg.overflow, on_untrainable=cfg.on_untrainable)
    if not examples:
        raise ConfigError(f"data: '{path}' gave no example to train on ({summary.describe()}); check data.format "
                          f"and data.fields against the records")
    return Rows(examples, seq_len, cfg.packing, pad_id), summary


def _check_vocabulary(tokenizer, vocab_size: int) -> None:
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} ids but the model's vocab_size is {vocab_size}: "
                          f"give the model a vocabulary of at least {len(tokenizer)} (a preset: "
                          f"trainer.model_overrides.vocab_size; a Hugging Face directory: its config.json)")


def _pad_id(tokenizer) -> int:
    """Padding is never attended or trained: any id in the vocabulary serves; the tokenizer's own if it has one."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0

"""The `data` section's files as training and validation rows: what `paratrain train` trains a fine-tuning job
on (docs/data.md).

    data = job_data(cfg.data, "models/tiny", seq_len=512, vocab_size=32000)
    data.train[i]          # a row: {"input_ids", "labels", "position_ids", "attention_mask"} of seq_len
    data.summary           # what reading and tokenizing did, every record counted

With `data.format: "preference"` the rows are Pairs (`preference_records.py`): each sample a pair of token-id
lists, collated by `data.train.collate_fn` into TRL's preference form padded to seq_len; never packed.

Every rank reads and tokenizes the same files the same way, so a bad file stops every rank with the same
error before any collective, and the rows (and so the sample order the sampler deals) are the same in every
layout. Tokenizing runs in `data.workers` processes (`workers.py`). With `data.streaming` the training rows
are a RowStream instead (`stream.py`): tokenized window by window while training, ahead of the step; a bad
record then stops every rank at the same step, when its window is dealt.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from paratrain.config.data import DataConfig
from paratrain.config.errors import ConfigError
from paratrain.data.json_records import DataError
from paratrain.data.preference_records import Pairs
from paratrain.data.rows import Rows
from paratrain.data.sources import iter_records, resolve_sources
from paratrain.data.stream import CHUNK_RECORDS, RowStream
from paratrain.data.tokenizer import load_tokenizer
from paratrain.data.workers import TokenizerPool, TokenizeSpec, chunks, merge_summaries


@dataclass
class JobData:
    train: Rows | RowStream | Pairs
    validation: Rows | Pairs | None
    summary: dict  # {"train": DataSummary fields, "validation": ..., "rows": ..., "padding_fraction": ...}


def job_data(cfg: DataConfig, model_dir: str | None, seq_len: int, vocab_size: int) -> JobData:
    """Read, tokenize and lay out `cfg.train` (and `cfg.validation`) in rows of `seq_len` tokens, with the
    tokenizer of `model_dir` (bytes for None)."""
    for key, path in (("data.train", cfg.train), ("data.validation", cfg.validation)):
        if path:  # a missing file is named by its key, before any tokenizer loads
            try:
                resolve_sources(path)
            except DataError as exc:
                raise DataError(f"{key} = '{path}': {exc}") from None
    tokenizer = load_tokenizer(model_dir)
    _check_vocabulary(tokenizer, vocab_size)
    pad_id = _pad_id(tokenizer)
    spec = TokenizeSpec(cfg.format, dict(cfg.fields), seq_len, cfg.overflow, cfg.on_untrainable,
                        None if model_dir is None else str(model_dir))
    pool = TokenizerPool(spec, cfg.workers)  # the stream keeps it; the in-memory path is done with it below
    try:
        validation, val_summary = (_rows(cfg, cfg.validation, pool, pad_id, None)
                                   if cfg.validation else (None, None))
        if cfg.streaming:  # a missing file has stopped the job above, not at the first step
            train = RowStream(lambda: _records(cfg, cfg.train, cfg.max_samples), spec, pool, seq_len=seq_len,
                              packing=cfg.packing, pad_id=pad_id, window_records=cfg.stream_window)
            summary = {"streaming": True, "stream_window": cfg.stream_window}
        else:
            train, train_summary = _rows(cfg, cfg.train, pool, pad_id, cfg.max_samples)
            summary = {"train": vars(train_summary), "train_rows": len(train),
                       "train_padding_fraction": train.padding_fraction(range(len(train)))}
    except BaseException:
        pool.close()
        raise
    if not cfg.streaming:
        pool.close()
    if validation is not None:
        summary |= {"validation": vars(val_summary), "validation_rows": len(validation)}
    return JobData(train, validation, summary)


def _records(cfg: DataConfig, path: str, limit: int | None):
    records = iter_records(path, text_sample_by=cfg.text_sample_by)
    return itertools.islice(records, limit) if limit is not None else records


def _rows(cfg: DataConfig, path: str, pool: TokenizerPool, pad_id: int, limit: int | None):
    results = list(pool.map(chunks(_records(cfg, path, limit), CHUNK_RECORDS)))
    examples = [example for chunk_examples, _ in results for example in chunk_examples]
    summary = merge_summaries(summary for _, summary in results)
    if not examples:
        raise ConfigError(f"data: '{path}' gave no example to train on ({summary.describe()}); check data.format "
                          f"and data.fields against the records")
    if cfg.format == "preference":
        return Pairs(examples, pool.spec.seq_len, pad_id), summary
    return Rows(examples, pool.spec.seq_len, cfg.packing, pad_id), summary


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

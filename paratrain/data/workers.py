"""Tokenization in worker processes: records in, (examples, summary) out, in the records' order.

    spec = TokenizeSpec("chat", {}, seq_len=512, overflow="split", on_untrainable="skip", model_dir="ckpt/")
    with TokenizerPool(spec, workers=2) as pool:
        for examples, summary in pool.map(chunks(records, 64)):   # one result per chunk, in order
            ...

Each worker loads the model directory's tokenizer once (bytes without one) and tokenizes whole chunks, so
only records and token ids cross the process boundary. Workers are started with "spawn", never "fork": a
rank's process holds the threads of its process groups (and a Rust tokenizer's thread pool), which a forked
child would inherit half-locked. With `workers=0` the calling process tokenizes (no process started).
A record's error (a malformed chat, a record with nothing to train on) is raised by `map` in the caller with
its file and line, exactly as tokenizing in the caller would raise it; a worker that dies raises
`BrokenProcessPool` there. A caller that dies takes its workers with it: each watches its parent and exits once it
is gone (a SIGKILLed rank cannot shut its pool down, and a worker blocked on the pool's queue never sees it close).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from paratrain.data.formats import DataSummary, Example, tokenize_records
from paratrain.data.preference_records import Pair, tokenize_pairs
from paratrain.data.tokenizer import load_tokenizer
from paratrain.errors import InvalidValueError


@dataclass(frozen=True)
class TokenizeSpec:
    """How the job tokenizes (the data section's fields), and whose tokenizer: all a worker needs."""

    fmt: str
    fields: dict = field(default_factory=dict)
    seq_len: int | None = None
    overflow: str = "split"
    on_untrainable: str = "skip"
    model_dir: str | None = None  # the tokenizer's directory; None: bytes


def chunks(records: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of `size` records (the last shorter)."""
    iterator = iter(records)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


class TokenizerPool:
    """`workers` processes that tokenize chunks of records the job's way (`TokenizeSpec`). A worker that dies
    (killed for memory, a crash inside a tokenizer) fails every pending result with `BrokenProcessPool` rather
    than leaving it waiting: the rank stops with the error instead of hanging."""

    def __init__(self, spec: TokenizeSpec, workers: int):
        if not isinstance(workers, int) or workers < 0:
            raise InvalidValueError(f"data.workers must be a whole number >= 0 (0: tokenize in the rank's own "
                                    f"process), got {workers!r}")
        self.spec, self.workers = spec, workers
        self._executor: ProcessPoolExecutor | None = None
        self._tokenizer = None
        if workers:
            self._executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_worker, initargs=(spec, os.getpid()))
            self._executor.submit(int)  # start the workers now: their start-up overlaps the caller's setup

    def map(self, record_chunks: Iterable[list]) -> Iterator[tuple[list[Example], DataSummary]]:
        """Each chunk tokenized, in order (with workers, every chunk is submitted at once)."""
        if self._executor is not None:
            return self._executor.map(_tokenize_chunk, record_chunks)
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.spec.model_dir)
        return (_tokenize(chunk, self.spec, self._tokenizer) for chunk in record_chunks)

    def submit(self, record_chunks: list[list]):
        """Start tokenizing `record_chunks` now; `.get()` on the result returns the list of (examples,
        summary) per chunk. Without workers the work happens at `.get()`."""
        if self._executor is not None:
            futures = [self._executor.submit(_tokenize_chunk, chunk) for chunk in record_chunks]
            return _Deferred(lambda: [future.result() for future in futures])
        return _Deferred(lambda: list(self.map(record_chunks)))

    def close(self) -> None:
        """Cancel what has not started, wait for what has (a chunk each), and end the workers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> TokenizerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge_summaries(summaries: Iterable[DataSummary]) -> DataSummary:
    total = DataSummary()
    for summary in summaries:
        for name, value in vars(summary).items():
            setattr(total, name, getattr(total, name) + value)
    return total


class _Deferred:
    def __init__(self, work):
        self._work = work

    def get(self):
        return self._work()


_WORKER: dict = {}  # in a worker process: its spec and tokenizer


PARENT_CHECK_S = 0.5  # how often a worker looks for its parent


def _start_worker(spec: TokenizeSpec, parent: int) -> None:
    threading.Thread(target=_exit_with, args=(parent,), name="paratrain-parent-watch", daemon=True).start()
    import torch  # noqa: PLC0415 (a worker tokenizes; one thread leaves the cores to the ranks)

    torch.set_num_threads(1)
    _WORKER["spec"], _WORKER["tokenizer"] = spec, load_tokenizer(spec.model_dir)


def _exit_with(parent: int) -> None:
    """End this worker once the process that started it is gone (it is re-parented: another parent pid)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def _tokenize_chunk(chunk: list) -> tuple[list[Example], DataSummary]:
    return _tokenize(chunk, _WORKER["spec"], _WORKER["tokenizer"])


def _tokenize(chunk: list, spec: TokenizeSpec, tokenizer) -> tuple[list[Example] | list[Pair], DataSummary]:
    if spec.fmt == "preference":  # pairs, never split: cut as TRL's keep_start (preference_records.py)
        return tokenize_pairs(chunk, tokenizer, fields=spec.fields or None, seq_len=spec.seq_len,
                              on_untrainable=spec.on_untrainable)
    return tokenize_records(chunk, spec.fmt, tokenizer, fields=spec.fields or None, seq_len=spec.seq_len,
                            overflow=spec.overflow, on_untrainable=spec.on_untrainable)

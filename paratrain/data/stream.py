"""Rows made while training (`data.streaming`): records read in pieces, tokenized by worker processes ahead of
the step, packed and dealt in windows, with a data position that any layout resumes.

    stream = RowStream(lambda: iter_records("train.jsonl"), spec, pool, seq_len=512, packing=True, pad_id=0,
                       window_records=4096)
    loader = StreamLoader(stream, micro_batch=2, dp_size=2, dp_rank=0, accumulation=2, seed=1, shuffle=True)
    batch = next(loader)              # this rank's micro-batch, as DataParallelLoader gives one
    loader.data_position()            # checkpoint state: resumed by any layout

[Note: windows]
The records are cut, in file order, into windows of `window_records`. Each window is tokenized (by the pool's
workers, one window ahead of the rows being dealt), packed best fit into rows of seq_len (or padded one per
row) and dealt in a permutation of its rows drawn from (seed, epoch, window); the epoch's rows are the windows'
rows one window after another, and the next epoch follows without a gap (no row is dropped at an epoch's end).
So the sequence of rows depends only on the files, the data section and the seed, never on the layout: every
rank builds the same sequence and takes its share of each global batch of it, as DataParallelSampler deals
(micro-step j of dp rank r takes rows [(j * dp + r) * micro, +micro) of the global batch). With one window
holding the whole file the first epoch's rows and their order are exactly those of the in-memory path (`Rows`
and DataParallelSampler with the same seed; the sampler then drops the epoch's incomplete last global batch).

[Note: the data position]
After whole global batches, the position is the next row's (epoch, window, rows of the epoch before the
window, rows of the window already dealt): a resumed run re-reads the records before the window without
tokenizing them, tokenizes that one window and skips the dealt rows. Any global batch size continues at the
next row not taken, so no row is repeated or skipped whatever the layout.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from paratrain.data.formats import DataSummary
from paratrain.data.rows import Rows
from paratrain.data.sources import DataError
from paratrain.data.workers import TokenizerPool, TokenizeSpec, chunks, merge_summaries

log = logging.getLogger("paratrain")

CHUNK_RECORDS = 64  # records per task a worker takes: big enough to amortize the transfer, small to balance
WINDOW_SEED_STRIDE = 1_000_003  # window w of epoch e shuffles with seed + e + w * stride (w = 0: the sampler's)


@dataclass(frozen=True)
class StreamPosition:
    """The next row of the stream (see the note)."""

    epoch: int = 0
    window: int = 0
    window_first_row: int = 0  # rows of the epoch before the window
    skip: int = 0  # rows of the window already dealt
    window_rows: int = 0  # rows the window has (0: not known); a resume finding another count warns

    @property
    def samples_in_epoch(self) -> int:
        return self.window_first_row + self.skip


@dataclass
class StreamRow:
    position: StreamPosition  # this row's own
    sample_id: int  # the row's index among the epoch's rows in file order (layout-free, as Rows' index)
    rows: Rows  # its window's rows
    index: int  # in `rows`

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.rows[self.index]

    @property
    def real_tokens(self) -> int:
        return self.rows.real_tokens[self.index]


class RowStream:
    """The job's rows as an endless sequence over epochs (the notes); `summary` counts what tokenizing did
    to each window this run has tokenized (every record of the data once the run has walked a whole epoch)."""

    def __init__(self, open_records: Callable[[], Iterator], spec: TokenizeSpec, pool: TokenizerPool, *,
                 seq_len: int, packing: bool, pad_id: int, window_records: int, source: str = "data.train"):
        self.open_records, self.spec, self.pool = open_records, spec, pool
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        self.window_records, self.source = window_records, source
        self._window_summaries: dict[int, DataSummary] = {}

    @property
    def summary(self) -> DataSummary:
        """What tokenizing did to every window tokenized so far (ahead of the step too)."""
        return merge_summaries(list(self._window_summaries.values()))

    def summary_of(self, windows) -> DataSummary:
        """What tokenizing did to `windows` (each counted once, whatever the epochs it was dealt in)."""
        return merge_summaries([self._window_summaries[w] for w in sorted(windows) if w in self._window_summaries])

    def rows_from(self, start: StreamPosition, seed: int, shuffle: bool) -> Iterator[StreamRow]:
        epoch, first_window, skip = start.epoch, start.window, start.skip
        while True:
            first_row, dealt = start.window_first_row if epoch == start.epoch else 0, 0
            for window, rows in self._windows(first_window):
                if epoch == start.epoch and window == start.window and start.window_rows not in (0, len(rows)):
                    log.warning("window %d of the data had %d rows when the checkpoint was written and has %d now: "
                                "the data changed (files, data.seq_len, data.packing, data.max_samples), so the "
                                "resumed rows are not the checkpointed run's", window, start.window_rows, len(rows))
                order = _order(len(rows), seed + epoch + window * WINDOW_SEED_STRIDE, shuffle)
                for k in range(skip, len(rows)):
                    yield StreamRow(StreamPosition(epoch, window, first_row, k), first_row + order[k], rows, order[k])
                first_row, skip, dealt = first_row + len(rows), 0, dealt + len(rows)
            if first_window == 0 and first_row == 0:
                raise DataError(f"{self.source}: gave no example to train on ({self.summary.describe()}); check "
                                f"data.format and data.fields against the records")
            epoch, first_window, skip = epoch + 1, 0, 0

    def _windows(self, first: int) -> Iterator[tuple[int, Rows]]:
        """(window, its rows) from window `first` on, each window's tokenization started one window ahead."""
        windows = enumerate(chunks(self.open_records(), self.window_records))
        pending = None
        for window, records in itertools.islice(windows, first, None):  # earlier windows: read, not tokenized
            job = (window, self.pool.submit(list(chunks(records, CHUNK_RECORDS))))
            if pending is not None:
                yield from self._rows_of(*pending)
            pending = job
        if pending is not None:
            yield from self._rows_of(*pending)

    def _rows_of(self, window: int, job) -> Iterator[tuple[int, Rows]]:
        results = job.get()
        self._window_summaries[window] = merge_summaries(summary for _, summary in results)
        examples = [example for chunk_examples, _ in results for example in chunk_examples]
        if examples:
            yield window, Rows(examples, self.seq_len, self.packing, self.pad_id)


def _order(n: int, seed: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """A thread that walks the stream ahead of the step into a bounded queue (errors travel in the queue)."""

    def __init__(self, rows: Iterator[StreamRow], capacity: int):
        self._rows, self._queue, self._stop = rows, queue.Queue(capacity), threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-data", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for row in self._rows:
                if not self._offer(row):
                    return
        except BaseException as error:  # noqa: BLE001 (re-raised in the training thread, at the step needing it)
            self._offer(_Failure(error))

    def _offer(self, item) -> bool:
        """Put `item` once there is room; False (nothing put) once stopped, so a stop never waits on a full
        queue and the walk ends at the next row."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def take(self, n: int) -> list[StreamRow]:
        out = []
        for _ in range(n):
            item = self._queue.get()
            if isinstance(item, _Failure):
                self._queue.put(item)  # every later take fails the same way
                raise item.error
            out.append(item)
        return out

    def stop(self) -> None:
        """Stop and wait for the thread (at most until the window it waits for is tokenized; a pool whose worker
        died raises instead of waiting): a thread left running at exit would be torn down inside torch."""
        self._stop.set()
        self._thread.join()

"""One rank's micro-batches from a RowStream (`stream.py`): what `engine.train_batch` draws when
`data.streaming` is on, with the same dealing and the same checkpoint contract as DataParallelLoader.

    loader = StreamLoader(stream, micro_batch=2, dp_size=2, dp_rank=0, accumulation=2, seed=1, shuffle=True)
    epoch, sample_ids = loader.next_global_batch()   # the next step's rows over every dp rank
    batch = next(loader)                             # this rank's next micro-batch
    state = loader.data_position()                   # after a step: where any layout resumes

The loader is its own sampler (`loader.sampler is loader`): the engine's TrainState asks the sampler for the
data position, and the trainer for the next global batch, as it does of DataParallelSampler. Rows are made by a
background thread (and the pool's workers) from the moment the loader is first used or resumed, a bounded
number of global batches ahead.
"""

from __future__ import annotations

import logging

from paratrain.config.errors import ConfigError
from paratrain.data.datasets import default_collate
from paratrain.data.stream import Prefetcher, RowStream, StreamPosition, StreamRow
from paratrain.errors import InvalidValueError

log = logging.getLogger("paratrain")

PREFETCH_GLOBAL_BATCHES = 4  # rows ready ahead of the step, in global batches


class StreamLoader:
    def __init__(self, stream: RowStream, micro_batch: int, dp_size: int, dp_rank: int, accumulation: int = 1,
                 seed: int = 0, shuffle: bool = True, collate_fn=None):
        self.stream, self.seed, self.shuffle = stream, seed, shuffle
        self.micro_batch, self.dp_size, self.dp_rank, self.accumulation = micro_batch, dp_size, dp_rank, accumulation
        self.global_batch = micro_batch * dp_size * accumulation
        self.collate_fn = collate_fn or default_collate
        self.position = StreamPosition()  # the next row not taken by a whole step
        self._batch: list[StreamRow] | None = None  # the current step's rows (over every dp rank)
        self._micro = 0  # micro-batches of the current step taken by this rank
        self._prefetcher: Prefetcher | None = None
        self._dealt_windows: set[int] = set()  # windows some step of this run took rows from

    @property
    def sampler(self) -> StreamLoader:
        return self

    @property
    def dataset(self) -> StreamLoader:  # the trainer asks the dataset for the padding of a global batch
        return self

    @property
    def seq_len(self) -> int:
        return self.stream.seq_len

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def _take_global_batch(self) -> list[StreamRow]:
        if self._batch is None:
            if self._prefetcher is None:
                rows = self.stream.rows_from(self.position, self.seed, self.shuffle)
                self._prefetcher = Prefetcher(rows, PREFETCH_GLOBAL_BATCHES * self.global_batch)
            self._batch = self._prefetcher.take(self.global_batch)
            self._dealt_windows.update(row.position.window for row in self._batch)
        return self._batch

    def next_global_batch(self) -> tuple[int, list[int]]:
        """(epoch of its first row, sample ids) of the rows the next optimizer step takes over every dp rank."""
        batch = self._take_global_batch()
        return batch[0].position.epoch, [row.sample_id for row in batch]

    def padding_fraction(self, sample_ids: list[int]) -> float:
        """The padding share of the next global batch's rows (`sample_ids`: what next_global_batch gave)."""
        batch = self._take_global_batch()
        if [row.sample_id for row in batch] != list(sample_ids):
            raise InvalidValueError("padding_fraction takes the sample ids of the next global batch (what "
                                    "next_global_batch() gave), not those of another batch")
        return 1.0 - sum(row.real_tokens for row in batch) / (len(batch) * self.stream.seq_len)

    def __iter__(self) -> StreamLoader:  # endless, like next(DataParallelLoader): a stream has no fixed epoch
        return self

    def __next__(self):
        batch = self._take_global_batch()
        start = (self._micro * self.dp_size + self.dp_rank) * self.micro_batch
        mine = batch[start:start + self.micro_batch]
        self._micro += 1
        if self._micro == self.accumulation:  # the step is whole: its rows are taken
            last = batch[-1].position
            self.position = StreamPosition(last.epoch, last.window, last.window_first_row, last.skip + 1,
                                           len(batch[-1].rows))
            self._batch, self._micro = None, 0
        return self.collate_fn([row.tensors() for row in mine])

    @property
    def samples_in_epoch(self) -> int:
        return self.position.samples_in_epoch

    def data_position(self) -> dict:
        """Checkpoint state: where the stream stands after whole steps (see stream.py's note)."""
        p = self.position
        return {"epoch": p.epoch, "samples_in_epoch": p.samples_in_epoch, "seed": self.seed,
                "global_batch": self.global_batch,
                "stream": {"window": p.window, "window_first_row": p.window_first_row, "window_rows": p.window_rows,
                           "window_records": self.stream.window_records}}

    def data_summary(self) -> dict:
        """What tokenizing did to the windows this run's steps took rows from (every record once a whole epoch
        was taken; windows tokenized ahead of the step but not reached are not counted)."""
        return vars(self.stream.summary_of(self._dealt_windows))

    def restore_position(self, state: dict) -> None:
        stream = state.get("stream")
        if stream is None:
            raise ConfigError("the checkpoint's data position is the in-memory sampler's (data.streaming false); "
                              "resume it with data.streaming false, or start a new run")
        if stream["window_records"] != self.stream.window_records:
            raise ConfigError(f"the checkpoint's stream was cut into windows of {stream['window_records']} "
                              f"records and this run's data.stream_window is {self.stream.window_records}: the "
                              f"rows would differ; set data.stream_window to {stream['window_records']} to resume")
        skip = state["samples_in_epoch"] - stream["window_first_row"]
        if state.get("global_batch", self.global_batch) != self.global_batch:
            log.info("resuming the stream %d rows into epoch %d with global batches of %d rows (the checkpoint's "
                     "were %d): this run's batches start at that row, none repeated or skipped",
                     state["samples_in_epoch"], state["epoch"], self.global_batch, state["global_batch"])
        self.close()
        self.seed = state["seed"]
        self.position = StreamPosition(state["epoch"], stream["window"], stream["window_first_row"], skip,
                                       stream.get("window_rows", 0))
        self._batch, self._micro = None, 0

    def state_dict(self) -> dict:
        return self.data_position()

    def load_state_dict(self, state: dict) -> None:
        self.restore_position(state)

    def close(self) -> None:
        """Stop making rows (the pool stays: a resumed position starts a new walk over it)."""
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None

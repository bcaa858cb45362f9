"""Streamed rows (`data.streaming`): tokenized in worker processes ahead of the step, window by window, with
the same rows and order as the in-memory path when one window holds the file, every row once per epoch, and
a data position any global batch resumes at the next row."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.config import ConfigError
from paratrain.config.data import DataConfig
from paratrain.data.datasets import DataParallelLoader, DataParallelSampler
from paratrain.data.job import job_data
from paratrain.data.sources import DataError
from paratrain.data.stream_loader import StreamLoader
from tests.distributed.test_data_job import write_records

SEED, SEQ = 5, 48


def _data(path, *, streaming: bool, window: int = 4096, workers: int = 0, fmt: str = "prompt_completion"):
    cfg = DataConfig(train=str(path), format=fmt, seq_len=SEQ, streaming=streaming, stream_window=window,
                     workers=workers)
    return job_data(cfg, None, SEQ, 260)


def _loader(stream, micro: int, dp: int, rank: int, accumulation: int) -> StreamLoader:
    return StreamLoader(stream, micro, dp, rank, accumulation, seed=SEED, shuffle=True)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "train.jsonl"
    write_records(path, 120)
    return path


def test_one_window_deals_the_in_memory_rows_in_the_sampler_order_tokenized_by_a_worker(records):
    memory = _data(records, streaming=False).train
    stream = _data(records, streaming=True, workers=1).train  # a spawned worker process tokenizes
    try:
        for rank in range(2):  # dp2, micro 2, accumulation 2: 8 rows a step, 5 steps
            want = DataParallelLoader(memory, DataParallelSampler(len(memory), 2, 2, rank, 2, seed=SEED))
            got = _loader(stream, 2, 2, rank, 2)
            for _ in range(5 * 2):
                expected, batch = next(want), next(got)
                assert all(torch.equal(expected[key], batch[key]) for key in expected)
            got.close()
    finally:
        stream.pool.close()
    assert vars(stream.summary) == _data(records, streaming=False).summary["train"]


def _rows(stream, n: int) -> list[tuple[int, int, list[int]]]:
    """The stream's first n rows one by one (a global batch of 1): (epoch, sample id, real tokens)."""
    loader, out = _loader(stream, 1, 1, 0, 1), []
    for _ in range(n):
        (epoch, (sample,)), batch = loader.next_global_batch(), next(loader)
        out.append((epoch, sample, batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()))
    loader.close()
    return out


def test_streamed_windows_hold_every_token_of_every_row_once_per_epoch(records):
    memory = _data(records, streaming=False).train
    want = sorted(t for i in range(len(memory)) for t in memory[i]["input_ids"][memory[i]["attention_mask"].bool()])
    stream = _data(records, streaming=True, window=7).train  # 18 windows, packed and shuffled apart
    rows = _rows(stream, 160)  # about 130 rows an epoch: small windows pack less tightly
    first = [(sample, tokens) for epoch, sample, tokens in rows if epoch == 0]
    assert sorted(sample for sample, _ in first) == list(range(len(first)))  # every row once, none dropped
    assert sorted(t for _, tokens in first for t in tokens) == want  # every document's tokens exactly once
    assert [epoch for epoch, _, _ in rows] == [0] * len(first) + [1] * (160 - len(first))
    assert stream.summary.records == 120  # every window tokenized (the next epoch's first ones again)


def test_each_epoch_deals_its_own_order_the_samplers_when_one_window_holds_the_file(records):
    """The permutation is drawn from (seed, epoch, window): epoch 1 is dealt in another order than epoch 0, and in
    the in-memory sampler's epoch-1 order when one window holds the file."""
    memory = _data(records, streaming=False).train
    n = len(memory)
    stream = _data(records, streaming=True).train
    rows = _rows(stream, 2 * n)
    sampler = DataParallelSampler(n, 1, 1, 0, 1, seed=SEED)
    epochs = [[sample for epoch, sample, _ in rows if epoch == e] for e in (0, 1)]
    assert epochs == [sampler._order_of(0), sampler._order_of(1)]
    assert epochs[0] != epochs[1] and sorted(epochs[1]) == list(range(n))


def test_a_stream_resumed_under_any_global_batch_continues_at_the_next_row(records):
    stream = _data(records, streaming=True, window=10).train
    reference = _rows(stream, 160)  # row by row, past the first epoch's end (131 rows)
    first = _loader(stream, 2, 2, 0, 2)  # global batch 8: 17 steps take 136 rows, into epoch 1
    for _ in range(17 * 2):
        next(first)
    position = json.loads(json.dumps(first.data_position()))  # as a checkpoint stores it
    first.close()
    taken_rows = 17 * 8
    epoch = reference[taken_rows][0]
    assert epoch == 1 and position["epoch"] == epoch
    assert position["samples_in_epoch"] == sum(1 for e, _, _ in reference[:taken_rows] if e == epoch)
    for micro, dp, accumulation in ((1, 3, 1), (2, 1, 2)):  # global batches of 3 and 4
        resumed = _loader(stream, micro, dp, 0, accumulation)
        resumed.restore_position(position)
        taken = []
        for _ in range(4):
            taken += resumed.next_global_batch()[1]
            for _ in range(accumulation):
                next(resumed)
        resumed.close()
        want = [sample for _, sample, _ in reference[taken_rows:taken_rows + len(taken)]]
        assert taken == want, (micro, dp, accumulation)


def test_stream_errors_name_the_record_and_positions_of_another_kind_are_refused(records, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(line) + "\n" for line in [{"text": "hello world"}] * 3 + [{"txt": "x"}]))
    stream = _data(bad, streaming=True, workers=1, fmt="text").train  # raised in the worker, re-raised here
    loader = _loader(stream, 1, 1, 0, 1)
    try:
        for _ in range(2):  # the error stays: every later draw raises it too
            with pytest.raises(DataError, match=r"bad.jsonl:4"):
                loader.next_global_batch()
    finally:
        loader.close()
        stream.pool.close()

    stream = _data(records, streaming=True, window=10).train
    position = _loader(stream, 1, 1, 0, 1).data_position()
    with pytest.raises(ConfigError, match=r"set data.stream_window to 10"):
        _loader(_data(records, streaming=True, window=11).train, 1, 1, 0, 1).restore_position(position)
    with pytest.raises(ConfigError, match=r"data.streaming true"):
        DataParallelSampler(100, 1, 1, 0).restore_position(position)
    with pytest.raises(ConfigError, match=r"data.streaming false"):
        _loader(stream, 1, 1, 0, 1).restore_position(DataParallelSampler(100, 1, 1, 0).data_position())


def _wait_until(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll `condition` (a state the background thread reaches), failing with `what` after `limit_s`."""
    import time

    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_close_returns_while_the_queue_is_full_and_a_later_window_failed(tmp_path):
    import threading

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(line) + "\n" for line in [{"text": "hello world"}] * 6 + [{"txt": "x"}]))
    stream = _data(bad, streaming=True, window=1, fmt="text").train  # one record per window: 6 good, then the bad
    loader = _loader(stream, 1, 1, 0, 1)  # a queue of 4 rows
    for _ in range(2):
        loader.next_global_batch()
        next(loader)
    prefetcher = loader._prefetcher
    _wait_until(prefetcher._queue.full, "the data thread never filled its queue")
    closing = threading.Thread(target=loader.close)
    closing.start()
    closing.join(timeout=60)  # a hang detector, not a speed check: close() used to wait forever here
    assert not closing.is_alive()


def test_a_killed_tokenizer_worker_fails_the_draw_instead_of_hanging(records):
    import os
    import signal
    from concurrent.futures.process import BrokenProcessPool

    stream = _data(records, streaming=True, window=10, workers=1).train
    executor = stream.pool._executor
    _wait_until(lambda: executor._processes, "the worker never started")
    for pid in list(executor._processes):
        os.kill(pid, signal.SIGKILL)
    loader = _loader(stream, 1, 1, 0, 1)
    try:
        with pytest.raises(BrokenProcessPool):
            loader.next_global_batch()
    finally:
        loader.close()
        stream.pool.close()


def test_a_resume_on_changed_data_warns(records, caplog):
    stream = _data(records, streaming=True, window=10).train
    first = _loader(stream, 2, 1, 0, 1)
    for _ in range(3):
        next(first)
    position = first.data_position()
    first.close()
    changed = job_data(DataConfig(train=str(records), format="prompt_completion", streaming=True,
                                  stream_window=10), None, SEQ // 2, 260).train  # shorter rows: more of them
    resumed = _loader(changed, 2, 1, 0, 1)
    resumed.restore_position(position)
    with caplog.at_level("WARNING", logger="paratrain"):
        resumed.next_global_batch()
    resumed.close()
    assert "the data changed" in caplog.text

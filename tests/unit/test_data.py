"""The embedded corpus and the data-parallel sampler."""

import torch

from paratrain.data import DataParallelSampler, TokenWindows, corpus_text, load_corpus


def test_corpus_is_embedded_and_split():
    train, val = load_corpus()
    assert len(corpus_text()) > 100_000
    assert train.dtype == torch.int64 and int(train.max()) < 256
    assert len(val) > 0 and abs(len(val) / (len(train) + len(val)) - 0.1) < 0.01


def test_windows_are_shifted_pairs():
    data = TokenWindows(torch.arange(100), 9)
    x, y = data[2]
    assert torch.equal(x, torch.arange(18, 27)) and torch.equal(y, torch.arange(19, 28))
    assert len(data) == 11


def test_ranks_and_micro_steps_cover_exactly_the_global_batch():
    n, mb, dp, acc = 100, 3, 4, 2
    ref = DataParallelSampler(n, mb * dp * acc, 1, 0, 1, seed=5)
    samplers = [DataParallelSampler(n, mb, dp, r, acc, seed=5) for r in range(dp)]
    for _ in range(9):  # crosses an epoch boundary (100 // 24 = 4 steps per epoch)
        want = sorted(ref.next_indices())
        got = sorted(i for _ in range(acc) for s in samplers for i in s.next_indices())
        assert got == want


def test_sampler_resumes_where_it_stopped():
    a = DataParallelSampler(50, 2, 2, 1, 1, seed=9)
    for _ in range(7):
        a.next_indices()
    state = a.state_dict()
    b = DataParallelSampler(50, 2, 2, 1, 1, seed=9)
    b.load_state_dict(state)
    assert [a.next_indices() for _ in range(20)] == [b.next_indices() for _ in range(20)]


def _take_steps(samplers: list[DataParallelSampler], steps: int) -> list[list[int]]:
    """Each optimizer step's samples over every dp rank, checked against next_global_batch."""
    out = []
    for _ in range(steps):
        epoch, want = samplers[0].next_global_batch()
        got = []
        for _ in range(samplers[0].accumulation):
            for s in samplers:
                got += s.next_indices()
        assert sorted(got) == sorted(want) and samplers[0].epoch == epoch
        out.append(want)
    return out


def test_resume_under_another_global_batch_continues_at_the_next_unseen_sample():
    first = [DataParallelSampler(50, 2, 2, r, accumulation=2, seed=5) for r in range(2)]  # 8 per step
    taken = [i for step in _take_steps(first, 3) for i in step]
    position = {"epoch": first[0].epoch, "samples_in_epoch": first[0].samples_in_epoch, "seed": 5}
    assert position["samples_in_epoch"] == 24
    # resumed with 3 x 1 x 2 = 6 per step: the epoch goes on at sample 24, then the next epoch starts whole
    second = [DataParallelSampler(50, 3, 1, 0, accumulation=2, seed=5)]
    second[0].resume_at(**position)
    rest = _take_steps(second, (50 - 24) // 6)
    taken += [i for step in rest for i in step]
    assert len(taken) == len(set(taken)) == 24 + 24  # no repeat; the 2 left over are the epoch's dropped tail
    assert taken == torch.randperm(50, generator=torch.Generator().manual_seed(5)).tolist()[:48]
    assert _take_steps(second, 1)[0] == torch.randperm(50, generator=torch.Generator().manual_seed(6)).tolist()[:6]


def test_the_documented_data_loader_table_is_the_committed_json():
    import json
    from pathlib import Path

    from benchmarks.data_loader import RESULT, table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    result = json.loads(RESULT.read_text())
    assert table(result) in doc
    assert result["loader_rows_per_s"] > 100 * result["step_rows_per_s"]  # the loader is never what a step waits on
    r = result  # the prose after the table says what the run measured, from the same JSON
    assert r["run_streaming"] and r["run_workers"] == 1 and r["run_stream_window"] == 64
    assert f"waited {r['loader_wait_s_median'] * 1e3:.1f} ms for its rows at the median" in doc
    assert f"{r['loader_wait_share']:.2%} of the run's time" in doc and r["loader_wait_share"] < 0.01  # ~ 0
    assert f"makes {r['stream_rows_per_s']:,.0f} rows/s with one worker, " in doc
    assert f"{r['stream_rows_per_s'] / r['step_rows_per_s']:.0f} times what the job consumes" in doc
    assert f"{r['workers2_records_per_s'] / r['workers1_records_per_s']:.2f}x the records per second" in doc


def test_a_loader_resumed_mid_epoch_iterates_the_rest_then_whole_epochs():
    from paratrain.data import DataParallelLoader

    loader = DataParallelLoader(list(range(50)), DataParallelSampler(50, 4, 1, 0, accumulation=2, seed=1))
    loader.sampler.resume_at(epoch=0, samples_in_epoch=24, seed=1)
    assert len(list(loader)) == (50 - 24) // 8 * 2  # the rest of epoch 0
    assert len(list(loader)) == 50 // 8 * 2 == len(loader)  # then a whole epoch 1

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

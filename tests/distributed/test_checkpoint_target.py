"""Checkpoints take stateful objects, never the engine: a CheckpointTarget with any extra `state_dict()` /
`load_state_dict()` objects round-trips them (one copy for the job, or one per rank), and the engine's own
state (TrainState, RandomState) follows the same rules."""

from __future__ import annotations

import random

import pytest
import torch

import paratrain
from paratrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from paratrain.engine.train_state import RandomState, TrainState
from paratrain.parallel.tp import RNGTracker
from tests.cases import adamw_config, corpus_windows, tiny_gpt


class Counter:
    """A user's stateful object: JSON values and a tensor."""

    def __init__(self, n: int = 0):
        self.n, self.seen = n, torch.zeros(3)

    def state_dict(self) -> dict:
        return {"n": self.n, "seen": self.seen, "history": (self.n - 1, self.n)}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.seen, self.history = state["n"], state["seen"], state["history"]


class Unstorable:
    def state_dict(self) -> dict:
        return {"ok": 1, "inner": {"callback": print}}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("never loaded")


def _round_trip(directory: str) -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2)
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())
    engine.train_batch()
    rank = engine.global_rank
    target = engine.checkpoint_target()
    job, mine = Counter(7), Counter(100 + rank)
    job.seen += 1.5
    mine.seen += rank
    target.states["counter"] = job
    target.rank_states["per_rank"] = mine
    save_checkpoint(target, directory, "t1")
    bad = engine.checkpoint_target()
    bad.states["unstorable"] = Unstorable()
    try:
        save_checkpoint(bad, directory, "t2")
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)

    fresh, *_ = paratrain.initialize(model=tiny_gpt(seed=4), config=cfg, training_data=corpus_windows())
    target = fresh.checkpoint_target()
    job_back, mine_back = Counter(), Counter()
    target.states["counter"] = job_back
    target.rank_states["per_rank"] = mine_back
    target.states["absent"] = Counter(-1)  # the checkpoint holds no state for it: left as it is
    load_checkpoint(target, directory, "t1")
    want, got = engine.full_state_dict(), fresh.full_state_dict()
    return {"job": (job_back.n, job_back.seen.tolist(), job_back.history),
            "mine": (mine_back.n, mine_back.seen.tolist()), "absent": target.states["absent"].n,
            "steps": fresh.global_steps, "refused": refused,
            "equal": all(torch.equal(want[k], got[k]) for k in want)}


def test_a_target_round_trips_any_stateful_objects_once_per_job_or_per_rank(world2, tmp_path):
    results = world2.run(_round_trip, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["job"] == (7, [1.5, 1.5, 1.5], [6, 7])
        assert r["mine"] == (100 + rank, [float(rank)] * 3)  # each rank its own
        assert r["absent"] == -1 and r["steps"] == 1 and r["equal"]
        assert "the state of 'unstorable'['inner']['callback'] is a builtin_function_or_method" in r["refused"]
    assert not (tmp_path / "t2").exists() and not (tmp_path / "t2.partial").exists()


def test_train_state_counts_micro_steps_in_the_loading_runs_accumulation():
    saved = TrainState(lambda: 4, global_steps=3, micro_steps=12, global_samples=96, skipped_steps=1)
    state = saved.state_dict()
    assert state["gradient_accumulation_steps"] == 4 and state["data"] is None
    loaded = TrainState(lambda: 2, window_micro_steps=1)
    loaded.load_state_dict(state)
    assert (loaded.global_steps, loaded.micro_steps, loaded.global_samples, loaded.skipped_steps) == (3, 6, 96, 1)
    assert loaded.window_micro_steps == 0


def test_random_state_restores_per_rank_streams_only_into_the_same_position():
    layout = {"sizes": {"dp": 1, "pp": 1, "cp": 1, "tp": 2}, "coords": {"dp": 0, "pp": 0, "cp": 0, "tp": 1}}
    stream = RNGTracker(seed=1, tp_rank=1)
    with stream.fork():
        torch.rand(5)  # the stream moves
    saved = RandomState({"tp": stream}, layout).state_dict()
    expected_default = torch.rand(3)
    expected_python = random.random()
    with stream.fork():
        expected_stream = torch.rand(3)

    same = RNGTracker(seed=1, tp_rank=1)
    RandomState({"tp": same}, layout).load_state_dict(saved)
    assert torch.equal(torch.rand(3), expected_default) and random.random() == expected_python
    with same.fork():
        assert torch.equal(torch.rand(3), expected_stream)

    other = RNGTracker(seed=1, tp_rank=1)
    elsewhere = {"sizes": {**layout["sizes"], "tp": 1, "dp": 2}, "coords": layout["coords"]}
    RandomState({"tp": other}, elsewhere).load_state_dict(saved)
    assert torch.equal(torch.rand(3), expected_default)  # the default generator continues in any layout
    with other.fork():
        assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(other.seed)))


@pytest.mark.parametrize("bad, where", [({1: "int key"}, r"the state of 'x'\[1\] sits under a non-string key"),
                                        ({"x": [2, object()]}, r"the state of 'x'\['x'\]\[1\] is a object"),
                                        ({"x": {"y": (1, {2})}}, r"the state of 'x'\['x'\]\['y'\]\[1\] is a set")])
def test_states_that_are_not_json_and_tensors_are_refused_by_path(bad, where):
    from paratrain.checkpoint.state import encode_state

    with pytest.raises(CheckpointError, match=where):
        encode_state(bad, {}, "state/x", "the state of 'x'")


def test_states_encode_to_json_with_their_tensors_beside():
    from paratrain.checkpoint.state import decode_state, encode_state

    tensors: dict = {}
    state = {"a": (3, [1.5, None, "s"]), "t": torch.arange(3), "n": {"m": [torch.ones(2), True]}}
    encoded = encode_state(state, tensors, "state/x", "x")
    assert encoded == {"a": [3, [1.5, None, "s"]], "t": {"__tensor__": "state/x/0"},
                       "n": {"m": [{"__tensor__": "state/x/1"}, True]}}
    back = decode_state(encoded, tensors.__getitem__)
    assert back["a"] == [3, [1.5, None, "s"]] and torch.equal(back["t"], torch.arange(3))
    assert torch.equal(back["n"]["m"][0], torch.ones(2)) and back["n"]["m"][1] is True

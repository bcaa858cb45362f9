"""Replica groups: which shards of a step each group trains (paratrain/trainer/replica_groups.py)."""

from __future__ import annotations

import pytest

from paratrain.trainer.replica_groups import shards_covered, shards_for


def test_every_shard_is_trained_exactly_once_whoever_is_up():
    assert [shards_for(4, 3, i) for i in range(3)] == [[0, 3], [1], [2]]
    assert [shards_for(2, 1, 0)] == [[0, 1]] and [shards_for(2, 2, i) for i in range(2)] == [[0], [1]]
    for groups in range(1, 7):
        for participants in range(1, groups + 1):
            owned = [j for i in range(participants) for j in shards_for(groups, participants, i)]
            assert sorted(owned) == list(range(groups)), (groups, participants)  # none twice, none dropped
            assert shards_covered(groups, participants) == set(range(groups))


@pytest.mark.parametrize("participants", [1, 2])
def test_a_group_beyond_the_quorum_trains_nothing(participants):
    assert shards_for(3, participants, participants) == []

"""The batch-agreement fingerprint (`paratrain.data.agreement`) tells apart micro-batches that differ in any way a
replica's peers could be fed differently: the order of tokens, the targets alone, the positions alone, the
documents alone."""

from __future__ import annotations

import torch

from paratrain.attention import Documents
from paratrain.data.agreement import fingerprint
from paratrain.data.micro_batch import MicroBatch

IDS = torch.arange(10, 26).reshape(2, 8)
TARGETS = IDS + 1
POSITIONS = torch.arange(8).repeat(2, 1)
DOCS = torch.tensor([[0] * 4 + [1] * 4, [0] * 8])


def _batch(ids=IDS, targets=TARGETS, positions=POSITIONS, docs=DOCS) -> MicroBatch:
    return MicroBatch(ids, targets, positions, Documents(docs))


def _swapped(t: torch.Tensor, a: tuple, b: tuple) -> torch.Tensor:
    t = t.clone()
    t[a], t[b] = t[b].clone(), t[a].clone()
    return t


def test_every_way_peers_could_differ_changes_the_fingerprint():
    base = fingerprint([_batch()])
    variants = {"two tokens swapped in a row": _batch(ids=_swapped(IDS, (0, 1), (0, 5))),
                "two tokens swapped across rows": _batch(ids=_swapped(IDS, (0, 2), (1, 2))),
                "the targets only": _batch(targets=_swapped(TARGETS, (1, 0), (1, 7))),
                "one target masked": _batch(targets=TARGETS.masked_fill(TARGETS == 20, -100)),
                "the positions only": _batch(positions=torch.cat([torch.arange(4), torch.arange(4)]).repeat(2, 1)),
                "the documents only": _batch(docs=torch.tensor([[0] * 3 + [1] * 5, [0] * 8]))}
    prints = {what: fingerprint([batch]) for what, batch in variants.items()}
    assert all(p != base for p in prints.values()), prints
    assert len(set(prints.values())) == len(prints)
    assert fingerprint([_batch()]) == base  # and the same batch gives the same number
    # and the order of the micro-batches of a step counts
    other = _batch(ids=IDS + 100)
    assert fingerprint([_batch(), other]) != fingerprint([other, _batch()])

"""Shared fixtures: one spawned world per size for the whole session (spawning costs seconds per rank)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _world(size: int):
    from paratrain.testing import World

    world = World(size, timeout_s=float(os.environ.get("PARATRAIN_TEST_TIMEOUT", "240")))
    world.start()
    return world


@pytest.fixture(scope="session")
def world1():
    w = _world(1)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def world2():
    w = _world(2)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def world4():
    w = _world(4)
    yield w
    w.stop()


@pytest.fixture(scope="session")
def world8():
    w = _world(8)
    yield w
    w.stop()

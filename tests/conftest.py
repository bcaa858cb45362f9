"""Shared fixtures: one spawned world per size for the whole session (spawning costs seconds per rank).

Tests that start other processes carry the `multiprocess` marker (`pytest -m "not multiprocess"` runs the
rest in seconds): those that use a world fixture get it here, the others (a World of their own, torchrun,
a CLI or script in a subprocess) say so themselves.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

WORLD_FIXTURES = ("world1", "world2", "world4", "world8")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in WORLD_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)


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

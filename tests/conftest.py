"""Shared fixtures: one spawned world per size for the whole session (spawning costs seconds per rank).

The suite has two lanes: `tests/unit/` starts no process (its conftest makes starting one fail), the fast
lane (`pytest tests/unit`); `tests/distributed/` holds every file that starts other processes (a world
fixture, a World of its own, torchrun, a CLI or script in a subprocess, data workers) and its tests carry the
`multiprocess` marker. Shared helpers (cases.py, real_data.py, ...) stay here.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

WORLD_FIXTURES = ("world1", "world2", "world4", "world8")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "distributed" in item.path.parts or \
                any(name in WORLD_FIXTURES for name in getattr(item, "fixturenames", ())):
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

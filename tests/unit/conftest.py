"""The fast lane starts no process: a test here that spawns one (a world, a subprocess, a worker pool) fails,
naming what it started, and belongs in tests/distributed/."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch, request):
    def refuse(what: str):
        def started(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} started {what}: a unit test starts no process; move it to "
                                 f"tests/distributed/")

        return started

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a process"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("a subprocess"))

"""The engine's phases: where each call's seconds go (`engine.timings()`), whether the engine was destroyed, and
failures shared with the other ranks. Every part of the engine (the step, evaluation, generation) enters its work
through `timed` or `together`, so an error on one rank stops the others at their next wait (`comm/guard.py`)
instead of at the communication timeout."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

from paratrain.engine.replicas import StepDiscarded
from paratrain.errors import RunError


class Phases:
    def __init__(self, guard):
        self.guard = guard  # the mesh's collective guard (None on one rank)
        self.times: dict[str, float] = defaultdict(float)
        self.destroyed = False

    @contextmanager
    def timed(self, name: str):
        """A phase of the step (forward, backward, step, comm_wait, pipeline): refused after destroy, timed, and
        its failure published."""
        if self.destroyed:
            raise RunError(f"engine.{name}: engine.destroy() was called, which freed its process groups; "
                           f"build a new engine with paratrain.initialize")
        start = time.perf_counter()
        try:
            with self.together():
                yield
        finally:
            self.times[name] += time.perf_counter() - start

    @contextmanager
    def together(self):
        """An error raised here on one rank is published for the others."""
        try:
            yield
        except StepDiscarded:  # every rank of the group discards the step together: nothing to tell the others
            raise
        except Exception as exc:
            if self.guard is not None:
                self.guard.publish_failure(exc)
            raise

"""A world of N spawned processes that stays up and runs many sub-cases (FSDP2's test pattern).

    with World(4) as world:
        results = world.run(check_ddp_parity, steps=5)   # one result per rank

`fn` must be importable (a module-level function). Each rank runs with torch.distributed (gloo) already
initialized and one thread. If a sub-case fails or times out on any rank, the world is killed (its ranks
may be stuck inside a collective, where no message reaches them) and restarted on the next `run`, so one
failure cannot hang the rest of a test session. A sub-case that leaves collectives unfinished on purpose
(a hang test) calls `restart()` afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_for

import torch.multiprocessing as mp

from paratrain.errors import Error


class WorldError(Error, RuntimeError):
    exit_code = 1  # a spawned rank failed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DROP_GROUPS = "drop-groups"
READY = "ready"  # what a rank sends once its process group exists
STARTUP_S = 300.0  # spawning, importing torch and joining the group: seconds on a loaded machine, never timed


def _worker(rank: int, world_size: int, port: int, conn, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    # The parent still ends this process with itself (it started it daemonic), but inside, the rank is an
    # ordinary process like a launched one: it may start its own workers (data.workers' tokenizers).
    multiprocessing.current_process().daemon = False
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    groups_before = set(_process_groups())
    conn.send(READY)
    while True:
        message = conn.recv()
        if message is None:
            break
        if message == DROP_GROUPS:  # every rank has finished the last sub-case
            _drop_groups_created_since(groups_before)
            continue
        fn, args, kwargs = message
        groups_before = set(_process_groups())
        try:
            conn.send((True, fn(*args, **kwargs)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
    dist.destroy_process_group()


def _process_groups() -> list:
    from torch.distributed import distributed_c10d

    world = distributed_c10d._get_default_group()
    return [g for g in distributed_c10d._world.pg_map if g is not world]


def _drop_groups_created_since(before: set) -> None:
    """[Note: one world, many engines] Every engine builds its mesh's groups anew and torch keeps every
    group until it is destroyed; gloo runs threads per group that wake now and then, so a world that has
    served a few hundred sub-cases spends its cores waking idle threads. Once every rank has answered a
    sub-case (the parent then sends DROP_GROUPS), no rank uses its groups any more; a rank that dropped
    them while a peer still waited in one would break that peer's wait instead."""
    import torch.distributed as dist

    for group in set(_process_groups()) - before:
        dist.destroy_process_group(group)
    gc.collect()  # the sub-case's engines sit in reference cycles: free their buffers now


class World:
    """`timeout_s` is gloo's timeout in every rank; a rank that has not answered `timeout_s + grace_s`
    after a `run` started, or `after_failure_s` after another rank failed, counts as hung."""

    def __init__(self, world_size: int, timeout_s: float = 300.0, grace_s: float = 30.0,
                 after_failure_s: float = 10.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.after_failure_s = after_failure_s
        self._procs: list = []
        self._conns: list = []

    def _death(self, rank: int) -> str:
        """What ended rank `rank`'s process: its exit code (-9: SIGKILL, what the out-of-memory killer sends)."""
        process = self._procs[rank]
        process.join(timeout=2.0)
        code = process.exitcode
        why = " (SIGKILL: the out-of-memory killer's signal)" if code == -9 else ""
        return f"the process died (exit code {code}{why})"

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, port, child, self.timeout_s), daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        """Start-up is not part of any sub-case's time limit: wait (up to STARTUP_S) for every rank to join."""
        deadline = time.monotonic() + STARTUP_S
        pending = list(self._conns)
        while pending:
            ready = wait_for(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                pending.remove(conn)
                try:
                    message = conn.recv()
                except EOFError:
                    message = "the process died"
                if message != READY:
                    self.kill()
                    raise WorldError(f"a rank of a world of {self.world_size} did not start: {message}")
        if pending:
            self.kill()
            raise WorldError(f"{len(pending)} rank(s) of a world of {self.world_size} did not start within "
                             f"{STARTUP_S:.0f}s")

    def stop(self, wait_s: float = 10.0) -> None:
        """Ask every rank to leave; kill those still there after `wait_s` (all ranks share the wait)."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        deadline = time.monotonic() + wait_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank still alive (a rank blocked inside a C++ collective reads no messages)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        """Kill the ranks now; the next `run` starts a fresh world."""
        self.kill()

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, fn, *args, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results or raise the first failure.

        Once a rank has failed, the others get `after_failure_s` more to answer: they are usually waiting
        for it inside a collective that will never complete.
        """
        if not self._procs:
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: list = [None] * self.world_size
        failures: dict[int, str] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + self.timeout_s + self.grace_s
        while pending:
            ready = wait_for(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    ok, value = conn.recv()
                except EOFError:
                    ok, value = False, self._death(rank)
                if ok:
                    results[rank] = value
                    continue
                failures[rank] = f"rank {rank}:\n{value}"
                deadline = min(deadline, time.monotonic() + self.after_failure_s)
        for rank in sorted(pending.values()):
            waited = "after another rank failed" if failures else f"within {self.timeout_s + self.grace_s:.0f}s"
            failures[rank] = f"rank {rank}: no answer {waited}"
        if failures:
            self.kill()
            raise WorldError(f"{getattr(fn, '__name__', fn)} failed on {len(failures)} rank(s):\n" +
                             "\n".join(failures[r] for r in sorted(failures)))
        for conn in self._conns:
            conn.send(DROP_GROUPS)
        return results

"""A world of N spawned processes that stays up and runs many sub-cases (FSDP2's test pattern).

    with World(4) as world:
        results = world.run(check_ddp_parity, steps=5)   # one result per rank

`fn` must be importable (a module-level function). Each rank runs with torch.distributed (gloo) already
initialized and one thread. If a sub-case fails or times out on any rank, the world is torn down and
restarted on the next `run`, so one failure cannot hang the rest of a test session.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


class WorldError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send((True, fn(*args, **kwargs)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    def __init__(self, world_size: int, timeout_s: float = 300.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list = []
        self._conns: list = []

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, port, child, self.timeout_s), daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def stop(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs, self._conns = [], []

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, fn, *args, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results or raise the first failure."""
        if not self._procs:
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results, failures = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout_s + 30):
                failures.append(f"rank {rank}: no answer within {self.timeout_s + 30:.0f}s")
                results.append(None)
                continue
            try:
                ok, value = conn.recv()
            except EOFError:
                ok, value = False, "the process died"
            results.append(value if ok else None)
            if not ok:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            self.stop()
            raise WorldError(f"{getattr(fn, '__name__', fn)} failed on {len(failures)} rank(s):\n" +
                             "\n".join(failures))
        return results

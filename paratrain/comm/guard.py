"""The hang guard: every collective is recorded while in flight and waited on with a timeout.

A rank that skips a collective (a branch taken on one rank only, a crashed peer, a mismatched schedule)
leaves the others blocked forever inside the backend. Instead, every wait here is bounded by
`comm.timeout_s`; when it expires — or when the backend gives up first with its own timeout (gloo's,
set at `init_process_group`) or a broken connection — the waiting rank writes a report naming what it was
waiting in, and raises `CollectiveTimeout`:

    paratrain: rank 2 stopped after waiting 2.0 s (comm.timeout_s) in all_reduce #3 on axis 'dp'
    (ranks 0, 1, 2, 3) [grad] shapes [(53248,)] float32; report: runs/x/hang_report_rank2.json

The report (`hang_report_rank{r}.json`, also printed to stderr) holds the collective (op, axis, call
number of that op on that axis on this process, tag, shapes, dtypes, the group's ranks, seconds waited),
everything else this rank had launched and not yet seen complete, and how many calls of each op it had
made per axis. Ranks that write no report are the ones that never reached the collective; comparing call
numbers across reports shows who fell behind.

[Note: why timed waits only for CPU tensors]
A timed `Work.wait` on a CUDA (NCCL) collective blocks the host until the GPU finishes, which would
serialize every tensor-parallel collective with the host. On NCCL the guard records calls but waits
untimed; NCCL's watchdog enforces the same timeout (`init_process_group(timeout=comm.timeout_s)`).

[Note: one rank's error, every rank's error]
A rank that raises inside a step (bad data on one rank, say) never reaches the next collective, and its peers
would wait there for the whole timeout. The engine publishes such an error in the process group's key-value
store (`publish_failure`); a timed wait that has not completed after `FIRST_WAIT_S` looks there every
`POLL_S` and raises `PeerFailed`, naming the rank and its error, so no rank waits for the timeout.
The fast path (a collective that completes at once) never touches the store.

[Note: stopping]
After a timeout the backend still holds the unfinished operation, and tearing the process group down
blocks until the peers leave. `paratrain.distributed` therefore ends the process at once (after the
traceback) when a `CollectiveTimeout` is not caught, instead of hanging at exit.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from paratrain.errors import Error, InvalidValueError


class CollectiveTimeout(Error, RuntimeError):
    """A collective did not complete within comm.timeout_s (or the backend failed while waiting)."""

    exit_code = 1  # the run failed, not its input

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


class PeerFailed(CollectiveTimeout):
    """Another rank raised an error inside the step this rank is waiting in (see the note above)."""


FIRST_WAIT_S = 1.0  # a collective's first wait before the guard looks for a failed peer
POLL_S = 0.5  # then, how often it looks
P2P_OPS = ("send", "recv")  # waited in one slice (`_timed_wait` says why)


@dataclass
class CallRecord:
    axis: str
    op: str
    call: int  # 1-based: the call-th `op` on `axis` made by this process
    tag: str
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    ranks: tuple[int, ...]  # global ranks of the group (or the peer, for send/recv)
    timed: bool  # wait with the timeout (CPU tensors; see the note on NCCL)
    started: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        shapes = ", ".join(str(s) for s in self.shapes)
        return (f"{self.op} #{self.call} on axis '{self.axis}' (ranks {ranks}) [{self.tag}] shapes [{shapes}] "
                f"{'/'.join(sorted(set(self.dtypes)))}")

    def as_dict(self, now: float) -> dict:
        out = asdict(self)
        out.pop("started")
        out["seconds_in_flight"] = round(now - self.started, 3)
        return out


class CommGuard:
    """Per-mesh watch over collectives: in-flight records, call numbers, timed waits, hang reports."""

    def __init__(self, rank: int, timeout_s: float = 600.0, report_dir: str | os.PathLike = "."):
        self.rank = rank
        self.timeout_s = timeout_s
        self.report_dir = Path(report_dir)
        self._calls: dict[tuple[str, str], int] = {}
        self._in_flight: dict[int, CallRecord] = {}
        self._ids = itertools.count()
        self._store = None  # the process group's key-value store, where a failing rank leaves its error
        self._failure_key: str | None = None

    def attach_store(self, store, key: str) -> None:
        """Where ranks publish an error raised inside a step: `key` in `store` (one key per mesh)."""
        self._store, self._failure_key = store, key

    def publish_failure(self, exc: BaseException) -> None:
        """Tell the other ranks that this rank raised `exc` inside a step (the first failure is kept)."""
        if self._store is None or isinstance(exc, CollectiveTimeout):
            return
        try:
            if not self._store.check([self._failure_key]):
                self._store.set(self._failure_key, f"rank {self.rank}: {type(exc).__name__}: {exc}"[:4000])
        except Exception:  # noqa: BLE001 - the store is a courtesy: the error itself is raised anyway
            pass

    def peer_failure(self) -> str | None:
        if self._store is None:
            return None
        try:
            if self._store.check([self._failure_key]):
                return self._store.get(self._failure_key).decode()
        except Exception:  # noqa: BLE001
            return None
        return None

    def configure(self, timeout_s: float | None = None, report_dir: str | os.PathLike | None = None) -> None:
        """Set the timeout and the report directory (the engine does this from the config's `comm` section)."""
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidValueError(f"comm.timeout_s must be > 0, got {timeout_s}")
            self.timeout_s = float(timeout_s)
        if report_dir is not None:
            self.report_dir = Path(report_dir or ".")

    # ---- records ------------------------------------------------------------------------------------
    def begin(self, axis: str, op: str, tag: str, tensors: list[torch.Tensor], ranks: tuple[int, ...]) -> int:
        number = self._calls.get((axis, op), 0) + 1
        self._calls[(axis, op)] = number
        record = CallRecord(axis, op, number, tag, [tuple(t.shape) for t in tensors],
                            [str(t.dtype).removeprefix("torch.") for t in tensors], tuple(ranks),
                            timed=all(t.device.type == "cpu" for t in tensors))
        key = next(self._ids)
        self._in_flight[key] = record
        return key

    def end(self, key: int) -> None:
        self._in_flight.pop(key, None)

    def record(self, key: int) -> CallRecord | None:
        return self._in_flight.get(key)

    # ---- waiting ------------------------------------------------------------------------------------
    def wait(self, work, key: int) -> None:
        """Wait for `work` (a torch.distributed Work) with the timeout; report and raise if it expires."""
        record = self._in_flight.get(key)
        try:
            if record is not None and record.timed:
                self._timed_wait(work, record)
            else:
                work.wait()
        except PeerFailed:
            self.end(key)
            raise
        except Exception as exc:  # the timeout above, or the backend's own (gloo: RuntimeError/DistBackendError)
            raise self.fail(key, exc) from exc
        self.end(key)

    def _timed_wait(self, work, record: CallRecord) -> None:
        """Wait at most the timeout, looking for a failed peer between slices (see the note above).

        A point-to-point op is waited in one slice: gloo closes the connection of a send or recv whose timed
        wait expires ("Application timeout caused pair closure"), so a second slice could never complete it,
        and its work says nothing while pending (`is_completed` stays False until waited). A pipeline's p2p
        wait is therefore bounded by the timeout but does not look for a failed peer; the collectives every
        step also runs (the gradient reductions, the loss) do."""
        deadline = time.monotonic() + self.timeout_s
        slice_s = self.timeout_s if record.op in P2P_OPS else min(FIRST_WAIT_S, self.timeout_s)
        while True:
            try:
                if work.wait(timeout=timedelta(seconds=slice_s)) is False:
                    raise TimeoutError("Work.wait returned False")
                return
            except Exception as exc:
                timed_out = isinstance(exc, TimeoutError) or "Operation timed out" in str(exc)
                if not timed_out or time.monotonic() >= deadline:
                    raise
            failed = self.peer_failure()
            if failed is not None:
                message = (f"paratrain: rank {self.rank} stopped in {record.describe()} because {failed} "
                           f"(raised inside the step; this rank was waiting for it)")
                print(message, file=sys.stderr, flush=True)
                raise PeerFailed(message, {"rank": self.rank, "peer": failed, "waiting_in": record.describe()})
            slice_s = max(min(POLL_S, deadline - time.monotonic()), 0.001)

    def run(self, fn, key: int):
        """Run a blocking call the backend bounds with its own timeout (e.g. all_gather_object)."""
        try:
            out = fn()
        except Exception as exc:
            raise self.fail(key, exc) from exc
        self.end(key)
        return out

    def fail(self, key: int, exc: BaseException) -> CollectiveTimeout:
        """Write the report for the collective `key`, print it, and return the exception to raise."""
        now = time.monotonic()
        record = self._in_flight.pop(key)
        waited = now - record.started
        # torch's Work.wait(timeout) raises "Operation timed out!"; anything else came from the backend.
        ours = isinstance(exc, TimeoutError) or "Operation timed out" in str(exc)
        reason = (f"waited {waited:.1f} s (comm.timeout_s = {self.timeout_s:g})" if ours
                  else f"the backend failed after {waited:.1f} s: {str(exc).strip()[:300]}")
        report = {"rank": self.rank, "reason": reason, "waiting_in": record.as_dict(now), "timeout_s": self.timeout_s,
                  "also_in_flight": [r.as_dict(now) for r in sorted(self._in_flight.values(), key=lambda r: r.started)],
                  "calls_made": {f"{axis}/{op}": n for (axis, op), n in sorted(self._calls.items())},
                  "pid": os.getpid(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path = self.report_dir / f"hang_report_rank{self.rank}.json"
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
            where = f"report: {path}"
        except OSError as err:
            where = f"(could not write {path}: {err})"
        report["path"] = str(path)
        message = f"paratrain: rank {self.rank} stopped: {reason} in {record.describe()}; {where}"
        print(message + "\n" + json.dumps(report), file=sys.stderr, flush=True)
        return CollectiveTimeout(message, report)

"""A job's failure, reported once: the message and its fix from the rank that found it, the exit code that says
whose fault it is, and the other ranks stopping quietly.

[Note: one report per job]
Most bad input is found by every rank at once (the project's rule: checked on every rank, before any
collective), and a rank left waiting in a collective fails in turn when its peer is gone ("Connection closed
by peer"). Printed as it comes, that is one traceback per rank with the message buried in the middle. So the
first rank to fail claims the report with a file created exclusively (`O_EXCL`) in the temporary directory,
named after the job's launcher process (torchrun's agent: every worker's parent; its pid and start time, so a
reused pid never finds an old claim) and the restart count; the winner prints, every other failing rank exits
with its code and says nothing. A file, not a collective: a collective could hang on the rank that is already
gone. The launcher (`paratrain run` / `train`) reads the claim after the workers are gone to print one final line
and exit with the winner's code, and removes it; under a plain `torchrun` the claim does the same between
workers (and stays behind, a few bytes), and torchrun's own summary follows.

Exit codes: 2 when the job's input is wrong (a paratrain error: config, data, adapter, checkpoint, model — what
the user fixes), 1 when the run failed (a paratrain `RunError`, a collective timeout, a non-finite loss; or
any other exception, a bug, whose traceback is printed). `PARATRAIN_DEBUG=1` (`--debug`) prints the traceback of
a paratrain error too. This module imports only `paratrain.errors`: entry points at every layer install it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from paratrain.errors import Error

DEBUG_ENV = "PARATRAIN_DEBUG"
USER_INPUT = 2  # the job's input is wrong: the message says what to change
RUN_FAILED = 1  # the run failed, or a bug
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it


def exit_code(exc: BaseException) -> int:
    """2 for a paratrain error about the job's input, 1 for a failed run or any other exception."""
    return getattr(exc, "exit_code", USER_INPUT) if isinstance(exc, Error) else RUN_FAILED


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def _started(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's field 22): with the pid, a name no later
    process of a reused pid has; "" where there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _prefix(agent_pid: int) -> str:
    return f"paratrain-failure-{agent_pid}-{_started(agent_pid)}-"


def claim_path(agent_pid: int | None = None) -> Path:
    """The claim file of this job's current attempt: named by the launcher (the worker's parent) and its start."""
    agent = agent_pid if agent_pid is not None else os.getppid()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Path(tempfile.gettempdir()) / f"{_prefix(agent)}{attempt}.json"


def _claim(record: dict) -> bool:
    """True when this rank is the first of the job to fail (see the note)."""
    try:
        fd = os.open(claim_path(), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # no temporary directory to share: every rank reports rather than none
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def _claims(agent_pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"{_prefix(agent_pid)}*.json"))


def read_claim(agent_pid: int) -> dict | None:
    """What the first failing worker of the launcher `agent_pid`'s latest attempt recorded, if any claimed."""
    for path in sorted(_claims(agent_pid), key=lambda p: int(p.stem.rsplit("-", 1)[1]), reverse=True):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def clear_claims(agent_pid: int) -> None:
    for path in _claims(agent_pid):
        path.unlink(missing_ok=True)


def _message(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and len(exc.args) == 1 else str(exc)  # KeyError quotes
    return text.removeprefix("paratrain: ")  # a message that names paratrain itself (the hang guard's)


def report(exc: BaseException, stream=None) -> int:
    """Print `exc` once for the whole job (a paratrain error as its message, anything else with its traceback)
    to `stream` (default: sys.stderr) and return the exit code the process should end with."""
    stream = stream or sys.stderr
    # Objects left in reference cycles (a closed process pool's queues) release their semaphores now: torchrun
    # stops the other ranks (SIGTERM) as soon as one has exited, and a rank stopped before its collector ran has
    # its semaphores reported leaked by multiprocessing's resource tracker, a warning on the user's screen.
    gc.collect()
    code = exit_code(exc)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not _claim({"rank": rank, "exit_code": code, "error": type(exc).__name__}):
        return code  # another rank reported first; this failure is the same or a consequence of it
    where = f" on rank {rank} of {world}" if world > 1 else ""
    sys.stdout.flush()
    if isinstance(exc, Error) and not debugging():
        print(f"paratrain: error{where}: {_message(exc)}", file=stream)
    else:
        print(f"paratrain: {'error' if isinstance(exc, Error) else 'unexpected failure'}{where}:", file=stream)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
    stream.flush()
    return code


def _excepthook(kind, exc, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):  # Ctrl-C reaches every rank: the launcher says it once
        sys.stdout.flush()
        os._exit(INTERRUPTED)
    if not issubclass(kind, Exception):
        sys.__excepthook__(kind, exc, tb)
        return
    # the process's own stderr: torch.distributed's hook (installed by init_process_group around this one) points
    # sys.stderr at a buffer while this runs, to prefix its lines, and would print it after this process ended
    code = report(exc, sys.__stderr__)
    sys.stdout.flush()
    os._exit(code)  # no atexit work: a peer may be gone, and a shutdown must not wait on it


def install_excepthook() -> None:
    """Report an uncaught exception of a launched rank as `report` does (a script under torchrun); keeps a hook the
    script installed itself, and a single process's usual traceback."""
    if "WORLD_SIZE" in os.environ and sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook


def interrupted(signal_number: int) -> int:
    """The launcher's line when the job was stopped by a signal (Ctrl-C: SIGINT), and its exit code."""
    import signal

    print(f"paratrain: the job was stopped ({signal.Signals(signal_number).name})", file=sys.stderr)
    return 128 + signal_number


def conclude(agent_pid: int, failures: dict) -> int:
    """After the workers of `agent_pid` are gone with a failure: one final line, and the job's exit code.
    `failures`: torchrun's {rank: ProcessFailure}."""
    claim = read_claim(agent_pid)
    if claim is not None:
        what = "an error in the job's input" if claim["exit_code"] == USER_INPUT else "a failure"
        print(f"paratrain: the job stopped: rank {claim['rank']} reported {what} (above); exit code "
              f"{claim['exit_code']}", file=sys.stderr)
        return int(claim["exit_code"])
    if not failures:
        print("paratrain: the job failed", file=sys.stderr)
        return RUN_FAILED
    rank, first = min(failures.items(), key=lambda item: item[1].timestamp)
    print(f"paratrain: the job failed: rank {rank} exited with code {first.exitcode}", file=sys.stderr)
    return first.exitcode if first.exitcode > 0 else RUN_FAILED

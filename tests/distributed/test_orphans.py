"""A killed rank leaves nothing behind: the tokenizer workers a process started (`paratrain.data.workers`) end once
it is SIGKILLed, though it never shut its pool down (they block on the pool's queue, which never closes for them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multiprocess

OWNER = """
import os, signal, sys
from paratrain.data.workers import TokenizeSpec, TokenizerPool
pool = TokenizerPool(TokenizeSpec("text", seq_len=16), workers=2)
pool.submit([[{"text": "a few words"}]] * 2).get()  # both workers up and working
print(" ".join(str(pid) for pid in pool._executor._processes), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit: as the out-of-memory killer or a fault test ends a rank
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) is gone too
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tokenizer_workers_end_when_their_rank_is_killed(tmp_path):
    out, err = tmp_path / "stdout", tmp_path / "stderr"  # files, not pipes: a surviving worker would hold a pipe open
    with out.open("w") as stdout, err.open("w") as stderr:
        owner = subprocess.run([sys.executable, "-c", OWNER], stdout=stdout, stderr=stderr, timeout=120,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert owner.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    workers = [int(pid) for pid in out.read_text().split()]
    assert len(workers) == 2, out.read_text()
    deadline = time.monotonic() + 10  # each looks for its parent every 0.5 s
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:  # the test leaves nothing behind either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"tokenizer workers {left} outlived their killed rank"

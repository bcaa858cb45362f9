"""A failed job says what is wrong once, on every launch path (docs/cli.md, "When a job fails").

`paratrain train --nproc-per-node 2`, `paratrain run` of a user script and a plain torchrun of the same script, each
with a missing data file, a bad config value and a LoRA target that matches no module: exit code 2, the message
exactly once (one rank prints it), no traceback; after a deliberate bug (an exception that is not a paratrain
error): exit code 1 and its traceback once. paratrain's launchers end with their own line, not torchrun's block;
a plain torchrun exits 1 whatever failed and adds its own traceback and block, with the rank's code in it.
Ctrl-C during training: one line, exit code 130, no traceback. The thirteen 2-process jobs run four at a time:
each is a separate job, only the waiting is shared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed.test_cli import ROOT, _free_port

SCRIPTS = ROOT / "tests" / "scripts"
OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-3}}
MODEL = {"vocab_size": 260, "seq_len": 32}
# case: (the config's extra keys, the line the user must see once, exit code)
CASES = {
    "data": ({"data": {"train": "missing.jsonl", "format": "prompt_completion", "seq_len": 32}},
             "data.train = 'missing.jsonl': missing.jsonl does not exist", 2),
    "config": ({"zero_optimization": {"stage": 4}},
               "config key 'zero_optimization.stage' = 4: Input should be less than or equal to 3", 2),
    "adapter": ({"peft": {"r": 4, "target_modules": ["qkv_nope"]}},
                "peft.target_modules entry 'qkv_nope' matches no module of Llama", 2),
    "bug": ({}, "ZeroDivisionError: a deliberate bug", 1),
}


def _config(tmp: Path, case: str) -> Path:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIMIZER, "steps_per_print": 100,
              "trainer": {"model": "llama-tiny", "model_overrides": MODEL, "steps": 1, "eval_every": 0,
                          "progress_bar": False, "run_dir": str(tmp / f"run-{case}")}, **CASES[case][0]}
    path = tmp / f"{case}.json"
    path.write_text(json.dumps(config))
    return path


def _command(path: str, case: str, tmp: Path) -> tuple[list[str], dict]:
    # TMPDIR: a plain torchrun leaves its job's failure claim behind (paratrain's launchers remove theirs)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    config, port = str(_config(tmp, case)), _free_port()
    if path == "train":
        if case == "bug":
            env |= {"PYTHONPATH": f"{SCRIPTS / 'bug_site'}{os.pathsep}{ROOT}", "PARATRAIN_TEST_BUG": "1"}
        return [sys.executable, "-m", "paratrain.cli", "train", "--config", config, "--nproc-per-node", "2",
                "--master-port", port], env
    script = [str(SCRIPTS / "failing_job.py"), case, config]
    if path == "run":
        return [sys.executable, "-m", "paratrain.cli", "run", "--nproc-per-node", "2", "--master-port", port,
                *script], env
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
            *script], env


def _launch(path: str, case: str, tmp: Path) -> subprocess.CompletedProcess:
    argv, env = _command(path, case, tmp)
    return subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=180)


def _interrupt(tmp: Path) -> subprocess.CompletedProcess:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once a long job has trained a step."""
    config = tmp / "long.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIMIZER, "trainer": {
        "model": "llama-tiny", "model_overrides": MODEL, "steps": 100000, "eval_every": 0, "progress_bar": False,
        "run_dir": str(tmp / "run-long")}}))
    argv, env = _command("train", "data", tmp)
    argv[argv.index("--config") + 1] = str(config)
    job = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    metrics, deadline = tmp / "run-long" / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.is_file() and metrics.stat().st_size) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if job.poll() is None:  # else it failed on its own: the assertions show how
        os.killpg(job.pid, signal.SIGINT)
    out, err = job.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, job.returncode, out, err)


@pytest.mark.multiprocess
def test_every_launch_path_reports_a_failure_once(tmp_path):
    jobs = [(path, case) for path in ("train", "run", "torchrun") for case in CASES]
    with ThreadPoolExecutor(4) as pool:
        stopped = pool.submit(_interrupt, tmp_path)
        done = dict(zip(jobs, pool.map(lambda job: _launch(*job, tmp_path), jobs)))
    stopped = stopped.result()  # Ctrl-C: no traceback from any rank nor torchrun, one line, exit code 130
    assert stopped.returncode == 130, stopped.stderr[-4000:]
    assert stopped.stderr.strip().splitlines()[-1] == "paratrain: the job was stopped (SIGINT)", stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr[-4000:]
    for (path, case), run in done.items():
        _, line, code = CASES[case]
        shown = run.stdout + run.stderr
        where = f"{path} {case}: rc {run.returncode}\n{shown[-4000:]}"
        if path == "torchrun":  # torchrun itself exits 1 whatever failed; its block shows the rank's code
            assert run.returncode == 1 and f"exitcode  : {code} (pid" in shown, where
        else:
            assert run.returncode == code, where
        assert shown.count(line) == 1, where
        torchruns_own = 1 if path == "torchrun" else 0  # a plain torchrun's traceback of its ChildFailedError
        assert shown.count("Traceback (most recent call last)") == (case == "bug") + torchruns_own, where
        assert shown.count("paratrain: ") == (2 if path != "torchrun" else 1), where  # the report (+ the last line)
        if path != "torchrun":  # torchrun's block is not the last word: paratrain's line is
            last = run.stderr.strip().splitlines()[-1]
            assert last.startswith("paratrain: the job stopped: rank ") and last.endswith(f"exit code {code}"), where
            assert "ChildFailedError" not in shown and "elastic/errors.html" not in shown, where

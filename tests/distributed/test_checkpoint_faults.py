"""Fault tolerance end to end: `paratrain run --max-restarts 2` with `checkpoint.auto_resume`, one worker
SIGKILLed by the test (at a random step, or in the middle of a save), finishes with parameters equal, bit
for bit, to an uninterrupted run, having trained on the same samples. The job is a fine-tuning job's (a data
section: the corpus's paragraphs as text records, streamed, tokenized by a worker process per rank), so the
data position is part of what must survive. Plus the checkpoint CLI (inspect, export, --hf, convert).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from paratrain.checkpoint.export import CheckpointReader
from paratrain.checkpoint.format import CheckpointError, read_latest
from paratrain.cli import main
from paratrain.data.corpus import corpus_text
from paratrain.models import GPT
from paratrain.models.gpt.hf_names import to_gpt2

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 9, 3
VOCAB = 260  # the byte tokenizer's 256 bytes and its special tokens
MODEL = {"dropout": 0.1, "bias": False, "vocab_size": VOCAB}  # dropout: resuming restores every rank's random state
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "seed": 3, "steps_per_print": 100,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.1}}, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 2},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
          "checkpoint": {"dir": "ck", "save_every": EVERY, "auto_resume": True},
          "data": {"train": "corpus.txt", "format": "text", "text_sample_by": "paragraph", "streaming": True,
                   "stream_window": 32, "workers": 1},
          "trainer": {"model": "gpt-tiny", "model_overrides": MODEL, "steps": STEPS, "eval_every": 0,
                      "progress_bar": False}}


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _start(cwd: Path, checkpoint: dict | None = None, **env) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "c.json").write_text(json.dumps({**CONFIG, "checkpoint": {**CONFIG["checkpoint"], **(checkpoint or {})}}))
    (cwd / "corpus.txt").write_text(corpus_text())
    argv = [sys.executable, "-m", "paratrain.cli", "run", "--max-restarts", "2", "--nproc-per-node", "2",
            "--master-port", _free_port(), "-m", "paratrain.cli", "train", "--config", "c.json", "--run-dir", "out"]
    return subprocess.Popen(argv, cwd=cwd, stdout=open(cwd / "log.txt", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env},
                            start_new_session=True)


def _finish(p: subprocess.Popen, cwd: Path, timeout: float = 240) -> str:
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and the workers it started
    log = (cwd / "log.txt").read_text()
    assert p.returncode == 0, log[-4000:]
    return log


def _workers(launcher: int) -> list[int]:
    """The worker processes: torchrun's agent runs inside the launcher, the workers are its children."""
    tasks = Path(f"/proc/{launcher}/task").iterdir()
    return [int(c) for task in tasks for c in (task / "children").read_text().split()]


def _wait_for(condition, p: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert p.poll() is None, "the job ended before the test could kill a worker"
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.02)


def _steps_done(cwd: Path) -> int:
    path = cwd / "out" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _cli(*args: str) -> int:
    """`paratrain checkpoint ...`, in this process (the same code the command runs)."""
    return main(["checkpoint", *args])


def _export(cwd: Path) -> dict[str, torch.Tensor]:
    assert _cli("export", str(cwd / "ck"), "--out", str(cwd / "final.safetensors")) == 0
    return load_file(cwd / "final.safetensors")


def _losses(cwd: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (cwd / "out" / "metrics.jsonl").read_text().splitlines()]


def _samples(cwd: Path) -> list[list[int]]:
    return [json.loads(line)["samples"] for line in (cwd / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("uninterrupted")
    _finish(_start(cwd), cwd)
    return cwd


def kill_plan(seed: int) -> tuple[int, int]:
    """The step after which a worker is killed, and which rank, drawn from `seed`."""
    rng = random.Random(seed)
    return rng.randint(2, STEPS - 1), rng.randint(0, 1)


def test_the_kill_plan_is_a_function_of_the_seed():
    assert kill_plan(7) == kill_plan(7)
    plans = {kill_plan(seed) for seed in range(200)}
    assert plans == {(step, rank) for step in range(2, STEPS) for rank in (0, 1)}  # every step and rank occur


def test_a_worker_killed_at_a_random_step_restarts_and_ends_equal(uninterrupted, tmp_path):
    # A new seed each run (the kill point varies over runs), printed and in every assertion message;
    # PARATRAIN_KILL_SEED=<seed> replays a failing run's kill point.
    seed = int(os.environ.get("PARATRAIN_KILL_SEED", random.SystemRandom().randrange(2**32)))
    kill_at, victim_rank = kill_plan(seed)
    print(f"kill seed {seed}: rank {victim_rank} after step {kill_at} (replay: PARATRAIN_KILL_SEED={seed})")
    p = _start(tmp_path)
    _wait_for(lambda: _steps_done(tmp_path) >= kill_at, p)
    os.kill(_workers(p.pid)[victim_rank], signal.SIGKILL)
    done = _steps_done(tmp_path)  # the job ran on while the signal travelled (a fast machine: a step or more)
    log = _finish(p, tmp_path)
    # the newest complete checkpoint before the kill: the one before step kill_at, or a later one if the job
    # got that far before the signal landed (its step's metrics line may still be unwritten: done + 1)
    allowed = {(step // EVERY) * EVERY for step in range(kill_at, done + 2)}
    found = re.search(r"\(resumed at step (\d+)\)", log)
    resumed = int(found.group(1)) if found else 0
    # the group was restarted: the new attempt resumed from a checkpoint, or (killed before the first one) started
    # again from nothing. (paratrain's launcher keeps torchrun's per-worker "failed (exitcode: -9)" lines quiet.)
    assert found is not None or log.count("no checkpoint to load") >= 2, (seed, log[-3000:])
    assert resumed in allowed and (found is not None) == (resumed > 0), (seed, allowed, log[-3000:])
    assert _losses(tmp_path) == _losses(uninterrupted), seed  # bit for bit, the metrics of one uninterrupted run
    assert _samples(tmp_path) == _samples(uninterrupted), seed  # the same rows, step by step
    want, got = _export(uninterrupted), _export(tmp_path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), seed


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_and_latest(uninterrupted, tmp_path, async_save):
    # every rank sleeps after writing its part (asynchronous: its writing thread, while training goes on)
    p = _start(tmp_path, {"async": async_save}, PARATRAIN_TEST_SAVE_PAUSE_S="1.5")
    partial = tmp_path / "ck" / f"global_step{2 * EVERY}.partial"
    _wait_for(lambda: (partial / "rank00001.safetensors").is_file(), p)
    # the step's row is written before its save starts: no kill after the save can lose a row the checkpoint names
    assert _steps_done(tmp_path) >= 2 * EVERY  # asynchronous: training goes on meanwhile
    os.kill(_workers(p.pid)[0], signal.SIGKILL)  # rank 0, before it writes the manifest
    # right now, before the restarted job saves again: the interrupted tag is not complete, latest is intact
    assert read_latest(tmp_path / "ck") == f"global_step{EVERY}"
    assert not (tmp_path / "ck" / f"global_step{2 * EVERY}").exists()
    assert CheckpointReader(tmp_path / "ck").manifest["states"]["train"]["global_steps"] == EVERY  # sha256-verified
    log = _finish(p, tmp_path)
    assert f"(resumed at step {EVERY})" in log, log[-3000:]
    assert not partial.exists() and read_latest(tmp_path / "ck") == f"global_step{STEPS}"
    assert _losses(tmp_path) == _losses(uninterrupted)  # the copy written at step 3 was step 3's, bit for bit
    want = CheckpointReader(uninterrupted / "ck").model_state()
    got = CheckpointReader(tmp_path / "ck").model_state()
    assert all(torch.equal(got[k], want[k]) for k in want)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # the row after a save carries its stall (the restarted attempt's save at step 6; the last one's is in the summary)
    assert [(r["step"], r["checkpoint/step"]) for r in rows if "checkpoint/stall_s" in r] == [(2 * EVERY + 1, 6)]
    saves = json.loads((tmp_path / "out" / "summary.json").read_text())["checkpoints"]  # the restarted attempt's
    assert [(s["step"], s["async"]) for s in saves] == [(2 * EVERY, async_save), (3 * EVERY, async_save)]
    assert all(s["write_s"] >= 1.5 for s in saves)  # the pause is inside the write, and the job waited for it


def _gpt2_logits(sd: dict[str, torch.Tensor], cfg: dict, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward as Hugging Face's GPT2LMHeadModel computes it (Conv1D: x @ W + b; c_attn -> q, k, v)."""
    d, nh = cfg["n_embd"], cfg["n_head"]
    b, s = idx.shape

    def ln(x, p):
        return F.layer_norm(x, (d,), sd[p + ".weight"], sd[p + ".bias"], cfg["layer_norm_epsilon"])

    def conv1d(x, p):
        return x @ sd[p + ".weight"] + sd[p + ".bias"]

    h = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][torch.arange(s)]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}"
        q, k, v = conv1d(ln(h, p + ".ln_1"), p + ".attn.c_attn").split(d, dim=2)
        q, k, v = (t.view(b, s, nh, d // nh).transpose(1, 2) for t in (q, k, v))
        w = (q @ k.transpose(-1, -2) / math.sqrt(d // nh)).masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + conv1d((w @ v).transpose(1, 2).reshape(b, s, d), p + ".attn.c_proj")
        x = conv1d(ln(h, p + ".ln_2"), p + ".mlp.c_fc")
        gelu_new = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))
        h = h + conv1d(gelu_new, p + ".mlp.c_proj")
    return ln(h, "transformer.ln_f") @ sd["lm_head.weight"].t()


def test_checkpoint_cli_inspect_export_hf_and_convert(uninterrupted, tmp_path, capsys):
    ck = str(uninterrupted / "ck")
    assert _cli("inspect", ck, "--tensors") == 0
    shown = capsys.readouterr().out
    assert f"(tag global_step{STEPS})" in shown and "layout: dp2 (2 ranks), ZeRO stage 2, fp32" in shown
    assert f"engine: global_steps {STEPS}, micro_steps {2 * STEPS}" in shown and "sha256 verified" in shown
    assert "optimizer: AdamW, 1 group(s), states exp_avg, exp_avg_sq, scalars step" in shown
    assert "model/embed.tok.weight" in shown and f"[{VOCAB}, 32]" in shown

    state = CheckpointReader(ck).model_state()
    # The command itself, in a fresh interpreter: the GPT's spec (its Hugging Face names) must be registered by
    # `import paratrain` alone, not by something this test process happened to import.
    command = "import sys; from paratrain.cli import main; sys.exit(main(sys.argv[1:]))"
    fresh = subprocess.run([sys.executable, "-c", command, "checkpoint", "export", ck, "--out",
                            str(tmp_path / "hf" / "model.safetensors"), "--hf"], capture_output=True, text=True,
                           timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["n_head"] == 4 and cfg["n_layer"] == 2 and cfg["tie_word_embeddings"] is False
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    ours = GPT("gpt-tiny", **{**MODEL, "dropout": 0.0})
    ours.load_state_dict(state)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(idx)
        assert torch.allclose(_gpt2_logits(sd, cfg, idx), want, atol=1e-5, rtol=1e-5)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel  # optional: the real thing, when installed
    except ImportError:
        pass
    else:
        model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
        model.load_state_dict(sd, strict=False)
        with torch.no_grad():
            assert torch.allclose(model(idx).logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(CheckpointError, match="this GPT's output head has a bias, which GPT-2's lm_head does not"):
        to_gpt2({**state, "head.bias": torch.zeros(VOCAB)})

    assert _cli("export", ck, "--out", str(tmp_path / "half.safetensors"), "--dtype", "bf16") == 0
    half = load_file(tmp_path / "half.safetensors")
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], state[k].bfloat16()) for k in state)

    assert _cli("convert", ck, str(tmp_path / "single")) == 0
    converted = CheckpointReader(tmp_path / "single")
    assert converted.path.name == f"global_step{STEPS}"
    assert list(converted.manifest["files"]) == ["rank00000.safetensors"]
    again = converted.model_state()
    assert all(torch.equal(again[k], state[k]) for k in state)
    capsys.readouterr()
    assert _cli("inspect", str(tmp_path / "nowhere")) == 2
    assert "has neither a manifest.json nor a 'latest' file" in capsys.readouterr().err

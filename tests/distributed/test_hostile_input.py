"""Hostile or broken input: each case gives one clear error naming the thing and the fix, raised before
training touches any state, with nothing on disk damaged.

Checkpoints (truncated, corrupted, missing rank part, interrupted save, edited manifest, another model's
shapes or layers, another optimizer, a dangling `latest`), config batch arithmetic, sizes that do not
divide, hostfile lines, NaN/inf losses (skip or stop, fp32 and bf16), malformed micro-batches, token ids
outside the vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import paratrain
from paratrain.checkpoint.load import STRICT_KEY
from paratrain.config import ConfigError, load_config, resolve_batch
from paratrain.data.batch_check import BatchChecker, BatchError
from paratrain.launcher.hostfile import HostfileError, parse_hostfile
from paratrain.parallel.tp import PlanError, resolve_plan
from tests.cases import adamw_config, corpus_windows, tiny_gpt

CONFIG = adamw_config(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 1})
TAG = "global_step2"
LAYERS_1 = [f"blocks.1.{n}" for n in ("attn.k.weight", "attn.o.weight", "attn.q.weight", "attn.v.weight", "ln1.bias",
                                      "ln1.weight", "ln2.bias", "ln2.weight", "mlp.fc.weight", "mlp.proj.weight")]


# ---- checkpoints ------------------------------------------------------------------------------------------
def _save(directory: str) -> None:
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=CONFIG, training_data=corpus_windows())
    for _ in range(2):
        engine.train_batch()
    engine.save_checkpoint(directory)


def _try_loads(cases: dict[str, tuple[str, dict, dict]]) -> dict:
    """Load each (directory, model overrides, config overrides); return the error and whether anything moved."""
    out = {}
    for name, (directory, model_kw, cfg_kw) in cases.items():
        engine, *_ = paratrain.initialize(model=tiny_gpt(seed=4, **model_kw), config={**CONFIG, **cfg_kw},
                                          training_data=corpus_windows(seq_len=model_kw.get("seq_len", 16)))
        before = engine.full_state_dict()
        try:
            engine.load_checkpoint(directory)
            error = None
        except paratrain.CheckpointError as exc:
            error = str(exc)
        after = engine.full_state_dict()
        out[name] = {"error": error, "untouched": all(torch.equal(before[k], after[k]) for k in before) and
                     engine.global_steps == 0 and not engine.optimizer.state}
    return out


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_broken_checkpoints_fail_identically_on_every_rank_before_touching_state(world2, tmp_path):
    good = tmp_path / "good"
    world2.run(_save, str(good))

    def copy(name: str) -> Path:
        shutil.copytree(good, tmp_path / name)
        return tmp_path / name / TAG

    size = (good / TAG / "rank00001.safetensors").stat().st_size
    with open(copy("truncated") / "rank00001.safetensors", "r+b") as f:
        f.truncate(size - 64)
    data = bytearray((good / TAG / "rank00001.safetensors").read_bytes())
    data[-5] ^= 0x40
    (copy("corrupted") / "rank00001.safetensors").write_bytes(bytes(data))
    (copy("missing_part") / "rank00001.safetensors").unlink()
    (copy("interrupted") / "manifest.json").unlink()
    manifest = copy("edited") / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"global_steps":2', '"global_steps":20', 1))
    copy("dangling")
    (tmp_path / "dangling" / "latest").write_text("global_step9\n")
    digests = _digest(tmp_path)

    cases = {name: (str(tmp_path / name), {}, {}) for name in
             ("truncated", "corrupted", "missing_part", "interrupted", "edited", "dangling")}
    cases["other_shape"] = (str(good), {"seq_len": 32}, {})
    cases["fewer_layers"] = (str(good), {"n_layer": 1}, {})
    cases["more_layers"] = (str(good), {"n_layer": 3}, {})
    cases["other_optimizer"] = (str(good), {}, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    results = world2.run(_try_loads, cases)

    def at(name: str) -> str:
        return str(tmp_path / name / TAG)

    rank1 = f"{at('%s')}/rank00001.safetensors"
    expected = {
        "truncated": f"checkpoint file '{rank1 % 'truncated'}' has {size - 64} bytes but the manifest records {size}: "
                     f"it is truncated or was overwritten; restore it or load another tag",
        "corrupted": f"checkpoint file '{rank1 % 'corrupted'}' fails its sha256 checksum: its contents are corrupted; "
                     f"restore it or load another tag",
        "missing_part": f"checkpoint file '{rank1 % 'missing_part'}' (rank 1's part) is missing; the checkpoint is "
                        f"incomplete: restore the file or load another tag",
        "interrupted": f"'{at('interrupted')}' has no manifest.json: the checkpoint is incomplete (a save was "
                       f"interrupted) or not a paratrain checkpoint; load another tag",
        "edited": f"'{at('edited')}/manifest.json' fails its checksum: the manifest was modified or corrupted; load "
                  f"another tag",
        "dangling": f"checkpoint directory '{tmp_path / 'dangling' / 'global_step9'}' does not exist; pass an existing "
                    f"directory (and tag), or save one first",
        "other_shape": f"'embed.pos.weight' has shape [16, 32] in checkpoint '{good / TAG}' but [32, 32] in this "
                       f"model: the checkpoint is of a different model; load a checkpoint of this model, or build "
                       f"the model with the checkpoint's sizes",
        "fewer_layers": f"checkpoint '{good / TAG}' has 10 tensor(s) this model does not: {', '.join(LAYERS_1[:8])}: "
                        f"it is of a different model; load a checkpoint of this model, or pass "
                        f"load_module_strict=False ({STRICT_KEY}) to ignore them",
        "more_layers": f"checkpoint '{good / TAG}' lacks 10 tensor(s) of this model: "
                       f"{', '.join(n.replace('blocks.1', 'blocks.2') for n in LAYERS_1[:8])}: it is of a different "
                       f"model; load a checkpoint of this model, or pass load_module_strict=False ({STRICT_KEY}) to "
                       f"keep their current values",
        "other_optimizer": f"checkpoint '{good / TAG}' holds AdamW optimizer states but the engine's optimizer is "
                           f"SGD; use the same optimizer, or pass load_optimizer_states=False to start it fresh",
    }
    for name, want in expected.items():
        for rank, per_rank in enumerate(results):
            assert per_rank[name]["error"] == want, (name, rank, per_rank[name]["error"])
            assert per_rank[name]["untouched"], (name, rank)
    assert _digest(tmp_path) == digests  # loading never writes


# ---- configuration, sizes, hostfiles (pure) -------------------------------------------------------------
def test_batch_arithmetic_that_does_not_add_up():
    cfg = load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as err:
        resolve_batch(cfg, 2)
    assert str(err.value) == ("batch sizes do not add up: train_batch_size = train_micro_batch_size_per_gpu x "
                              "gradient_accumulation_steps x data-parallel size (2), but 10 != 2 x 2 x 2 = 8. Fix: set "
                              "train_batch_size to 8, or remove one of the three keys and it will be derived")


def test_sizes_that_do_not_divide():
    with pytest.raises(ConfigError) as err:
        paratrain.resolve_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"size": 3}}, 4)
    assert str(err.value) == ("pipeline.stages (1) x context_parallel.size (1) x tensor_parallel.size (3) = 3 does "
                              "not divide the world size 4; launch a multiple of 3 processes or change the sizes")
    with pytest.raises(PlanError) as err:
        resolve_plan(tiny_gpt(), None, 3, False)
    assert str(err.value) == ("'blocks.0.attn.q' (colwise) splits out_features 32 over tensor_parallel.size 3, which "
                              "does not divide it; choose a size that divides 32")


@pytest.mark.parametrize("text,message", [
    ("worker-0 slots=2\nworker-1 slots:4\n", "hostfile line 2: 'worker-1 slots:4' is not 'HOST slots=N' (e.g. "
                                             "'worker-0 slots=8'); fix or comment out the line"),
    ("worker-0 slots=0\n", "hostfile line 1: host 'worker-0' has slots=0; use slots >= 1"),
    ("a slots=1\n# x\na slots=2\n", "hostfile line 3: host 'a' is listed twice; keep one line per host"),
    ("# nothing\n\n", "hostfile lists no hosts; add lines like 'worker-0 slots=8'"),
])
def test_hostfile_with_bad_lines(text, message):
    with pytest.raises(HostfileError) as err:
        parse_hostfile(text)
    assert str(err.value) == message


# ---- NaN / inf losses --------------------------------------------------------------------------------------
class _Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 1, bias=False)

    def forward(self, x, y):
        return ((self.fc(x) - y) ** 2).mean()


def _batches(rank: int, poison: float, dtype: torch.dtype, steps: int = 4):
    g = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
        if step == 2 and rank == 1:
            x[0, 0] = poison  # one bad sample on one rank, at step 2
        yield x.to(dtype), y.to(dtype)


def _nonfinite(policy: str, precision: str, poison: float, extra: dict | None = None) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("paratrain").addHandler(handler)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "nonfinite_loss": policy, "zero_optimization": {"stage": 1 if precision == "bf16" else 0}, **(extra or {})}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = paratrain.initialize(model=_Regression(), config=cfg)
    data = _batches(engine.global_rank, poison, torch.bfloat16 if precision == "bf16" else torch.float32)
    weights, error = [engine.full_state_dict()["fc.weight"].clone()], None
    try:
        for _ in range(4):
            engine.train_batch(data)
            weights.append(engine.full_state_dict()["fc.weight"].clone())
    except paratrain.NonFiniteLossError as exc:
        error = str(exc)
        weights.append(engine.full_state_dict()["fc.weight"].clone())
    logging.getLogger("paratrain").removeHandler(handler)
    return {"error": error, "weights": weights, "skipped": engine.skipped_steps, "steps": engine.global_steps,
            "log": records}


@pytest.mark.parametrize("precision,poison,norm", [("fp32", float("nan"), "nan"), ("bf16", float("inf"), "inf")])
def test_nonfinite_loss_is_skipped_or_stops_on_every_rank(world2, precision, poison, norm):
    skipped = world2.run(_nonfinite, "skip", precision, poison)
    for r in skipped:
        assert r["error"] is None and r["skipped"] == 1 and r["steps"] == 4
        w = r["weights"]  # before step 1, after steps 1..4
        assert torch.equal(w[2], w[1]) and not torch.equal(w[3], w[2]) and torch.isfinite(w[4]).all()
    assert any(m.startswith(f"step 2 skipped: the global gradient norm is {norm} (the loss or a gradient is NaN/inf)")
               for m in skipped[0]["log"]), skipped[0]["log"]
    stopped = world2.run(_nonfinite, "stop", precision, poison)
    message = (f"step 2: the global gradient norm is {norm}: the loss or a gradient became NaN/inf on some rank, and "
               "nothing was updated. Lower the learning rate, enable gradient_clipping, check the data, or set "
               "nonfinite_loss to \"skip\" to skip such steps")
    for r in stopped:
        assert r["error"] == message
        assert torch.equal(r["weights"][-1], r["weights"][1])  # the bad step changed nothing
    assert message in stopped[0]["log"]


def _late_stop(tmp: str) -> dict:
    """stop_at_log: step 2 is poisoned; step 3 (no log line due) runs; the save after it refuses to write."""
    result = _nonfinite("stop_at_log", "fp32", float("nan"), {"steps_per_print": 100})
    engine_error = None
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "nonfinite_loss": "stop_at_log", "steps_per_print": 100}
    engine, *_ = paratrain.initialize(model=_Regression(), config=cfg)
    data = _batches(engine.global_rank, float("nan"), torch.float32)
    for _ in range(3):
        engine.train_batch(data)
    try:
        engine.save_checkpoint(tmp)
    except paratrain.NonFiniteLossError as exc:
        engine_error = str(exc)
    saved = os.listdir(tmp) if os.path.isdir(tmp) else []
    return {**result, "save_error": engine_error, "saved": saved}


def test_nonfinite_stop_at_log_reads_nothing_per_step_and_never_saves_the_result(world2, tmp_path):
    runs = world2.run(_late_stop, str(tmp_path / "ckpt"))
    for r in runs:
        assert r["error"] is None and r["steps"] == 4  # no log step, no save: all four steps ran
        assert not torch.isfinite(r["weights"][2]).all() and torch.isfinite(r["weights"][1]).all()
        assert r["save_error"].startswith("step 2: the global gradient norm was nan: the loss or a gradient became "
                                          "NaN/inf on some rank. With nonfinite_loss \"stop_at_log\"")
        assert r["saved"] == []
    logged = world2.run(_nonfinite, "stop_at_log", "fp32", float("nan"), {"steps_per_print": 3})
    for r in logged:  # raised at the log step 3, naming step 2
        assert r["error"].startswith("step 2: the global gradient norm was nan") and r["steps"] == 2, r["error"]


# ---- malformed micro-batches and token ids -----------------------------------------------------------------
def test_batch_checker_names_the_position_and_both_specs():
    check = BatchChecker("shape", "training")
    check((torch.zeros(2, 4), {"mask": torch.ones(2, 4, dtype=torch.bool)}))
    check((torch.ones(2, 4), {"mask": torch.zeros(2, 4, dtype=torch.bool)}))
    with pytest.raises(BatchError) as err:
        check((torch.zeros(2, 5), {"mask": torch.ones(2, 4, dtype=torch.bool)}))
    assert str(err.value) == (
        "training micro-batch 3: batch[0] is a float32 tensor of shape (2, 5), but in the first micro-batch it was a "
        "float32 tensor of shape (2, 4); every micro-batch must have the structure, dtypes and shapes of the first "
        "one (set batch_check to \"dtype\" to allow shapes that vary, e.g. variable sequence lengths). Fix the "
        "dataset or collate_fn")
    with pytest.raises(BatchError, match=r"batch\[1\]\['mask'\] is a float32 tensor of shape \(2, 4\), but in the "
                                         r"first micro-batch it was a bool tensor of shape \(2, 4\)"):
        check((torch.zeros(2, 4), {"mask": torch.zeros(2, 4)}))
    with pytest.raises(BatchError, match=r"batch has 3 elements, but the first micro-batch had 2"):
        check((torch.zeros(2, 4), {}, 1))
    relaxed = BatchChecker("dtype", "training")
    relaxed(torch.zeros(2, 4, dtype=torch.long))
    relaxed(torch.zeros(2, 7, dtype=torch.long))  # another sequence length is fine
    with pytest.raises(BatchError, match=r"batch is an int64 tensor of shape \(2,\), but in the first micro-batch"):
        relaxed(torch.zeros(2, dtype=torch.long))


class _Mixed(torch.utils.data.Dataset):
    """Token windows where sample `bad` is broken in the way `how` says."""

    def __init__(self, how: str, bad: int):
        self.windows, self.how, self.bad = corpus_windows(), how, bad

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x, y = self.windows[i]
        if i == self.bad:
            x = {"short": x[:-1], "float": x.float(), "vocab": x + 256}[self.how]
        return x, y


def _bad_data(how: str) -> str:
    cfg = {**CONFIG, "tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 0},
           "train_micro_batch_size_per_gpu": 1}
    windows = corpus_windows()
    bad = torch.randperm(len(windows), generator=torch.Generator().manual_seed(cfg["seed"])).tolist()[3]
    engine, *_ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=_Mixed(how, bad))
    try:
        for _ in range(4):  # the sampler's 4th micro-batch is the broken sample
            engine.train_batch()
    except ValueError as exc:  # BatchError and TokenIdError are ValueErrors
        return f"{type(exc).__name__}: {exc} [global_steps={engine.global_steps}]"
    return "no error"


def test_malformed_samples_and_token_ids_outside_the_vocabulary(world2):
    tail = ("; every micro-batch must have the structure, dtypes and shapes of the first one (set batch_check to "
            "\"dtype\" to allow shapes that vary, e.g. variable sequence lengths). Fix the dataset or collate_fn "
            "[global_steps=3]")
    assert world2.run(_bad_data, "short") == 2 * [
        "BatchError: training micro-batch 4: batch[0] is an int64 tensor of shape (1, 15), but in the first "
        "micro-batch it was an int64 tensor of shape (1, 16)" + tail]
    assert world2.run(_bad_data, "float") == 2 * [
        "BatchError: training micro-batch 4: batch[0] is a float32 tensor of shape (1, 16), but in the first "
        "micro-batch it was an int64 tensor of shape (1, 16)" + tail]
    vocab, = set(world2.run(_bad_data, "vocab"))  # under tp2 the vocabulary is split: no rank would notice
    assert vocab.startswith("TokenIdError: GPT token ids must lie in [0, 256) (vocab_size = 256), got values in [")
    assert re.search(r"\] \(first at row \d+, position \d+ of the micro-batch: \d+\): the data does not match", vocab)
    assert vocab.endswith("the data does not match the model's vocabulary; fix the dataset/tokenizer or build "
                          "the GPT with a larger vocab_size [global_steps=3]")

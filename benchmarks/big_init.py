"""Bigger than one rank: a Llama whose fp32 training state is larger than any rank's peak memory, built on the
meta device, materialized shard by shard, loaded from a safetensors file and trained, at 4 ranks.

    python -m benchmarks.big_init                     # llama-350m: 349M parameters, 5.6 GB of fp32 state
    python -m benchmarks.big_init --model llama-mini  # the same run on a small model (what the test runs)

Cases, each in a fresh spawned world of 4 ranks (so every peak RSS is its own):
  paratrain ZeRO-3 (dp4), paratrain ZeRO-1 (dp2 x tp2): init (`paratrain.init_empty` + initialize), load
      (`engine.load_weights` of the file), then STEPS training steps; ZeRO-3 (dp4) once more with
      `meta_init: "sharded"` (each rank draws only its shard, not eager construction's values);
  DeepSpeed ZeRO-3: the model built under `deepspeed.zero.Init`, then `deepspeed.initialize` and the steps, at
      its defaults and with the settings that lower its init peak (sub_group_size 1e7: the fp32 partitions are
      flattened in groups of 1e7 elements instead of one group of up to 1e9; no parameter kept whole);
  torch FSDP2: the model built on the meta device, `fully_shard` per layer and root, `to_empty`, then
      `init_weights` on the shards, and the steps.
Each rank reports its peak RSS (`ru_maxrss`) once the meta model is built, after init, after load and after
the first steps, and the formula: the process's RSS before the model existed + the model state this layout
holds at that point
(`paratrain.zero.estimate_memory`'s params of this rank's Ψ before the first step, and its grads where they
exist before it, stages 0-1; with the grads and optimizer states after it) + one full copy of the largest
parameter (the module being initialized or read).
Every case runs the same AdamW (fused), seed, data and micro-batch, and records its config (`setup`) and what
it built (`fair`: optimizer class and flags, threads, dtype, seeds, micro-batch, clipping), which must agree
over every case and rank before the result is written. Cases
repeat `--repeats` times, interleaved; the table gives the median of the worst rank and the spread over repeats.
DeepSpeed's initialize already builds what paratrain builds at the first step (its fp32 partition groups and
optimizer state), so compare its init with paratrain's first steps too. A rank that dies is recorded with its
exit code (-9: SIGKILL, the out-of-memory killer's signal). Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.big_init_report import check_fair, table
from benchmarks.common import (
    ADAMW,
    FUSED,
    deepspeed_optimizer,
    paratrain_optimizer,
    record_optimizer,
    torch_adamw,
)
from paratrain.engine.monitor import peak_rss_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "big_init.json"
WORLD = 4
STEPS = 2
MICRO_BATCH = 1
SEQ_LEN = 64
MIB = 2**20
MODEL_SEED = 0
CLIP = 1.0


def _model(name: str):
    from paratrain.models import Llama

    torch.manual_seed(MODEL_SEED)
    model = Llama(name, seq_len=SEQ_LEN)
    model.init_seed = MODEL_SEED
    return model


def _save_weights(name: str, path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in _model(name).state_dict().items()}, path)


def write_weights(name: str, path: Path) -> Path:
    """A child process builds the model eagerly and writes it as `save_pretrained` would (once per model).
    Not this process: Linux keeps a process's peak RSS (`ru_maxrss`) across fork and exec, so every rank
    spawned later would report the writer's peak as its own."""
    import multiprocessing

    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = multiprocessing.get_context("spawn").Process(target=_save_weights, args=(name, str(path)))
        writer.start()
        writer.join()
        if writer.exitcode != 0 or not path.is_file():
            raise RuntimeError(f"writing {path} failed (exit code {writer.exitcode})")
    return path


def _fair(optimizer, model, clip: float) -> dict:
    """What must be equal between the cases, read from what each built (`check_same_setup` compares them)."""
    return {"optimizer": record_optimizer(optimizer), "threads": torch.get_num_threads(),
            "dtype": " ".join(sorted({str(p.dtype) for p in model.parameters()})),
            "seed": {"model": getattr(model, "init_seed", None), "data": "1 + dp rank"},
            "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "gradient_clipping": clip}


def _batches(vocab: int, dp_rank: int):
    """Random token windows, the same on every rank of a data-parallel replica (tp peers see one batch)."""
    generator = torch.Generator().manual_seed(1 + dp_rank)
    while True:
        idx = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1), generator=generator)
        yield idx[:, :-1], idx[:, 1:]


def _formula(baseline: int, local_params: int, dp: int, stage: int, largest: int, with_optimizer: bool) -> int:
    from paratrain.zero import estimate_memory

    state = estimate_memory(local_params, dp=dp, stage=stage)
    # Stages 2-3 make their fp32 gradient shard at the first backward (stages 0-1 keep buckets from init on).
    grads = state["grads"] if with_optimizer or stage <= 1 else 0
    held = state["params"] + grads + (state["optimizer_state"] if with_optimizer else 0)
    return int(baseline + held + 4 * largest)


PROGRESS_ENV = "PARATRAIN_BIG_INIT_PROGRESS"


def _reached(phase: str, **values) -> None:
    """Leave this rank's peak RSS after `phase` on disk as it goes, so a rank killed later (for memory) still
    tells what it reached."""
    directory = os.environ.get(PROGRESS_ENV)
    if directory:
        path = Path(directory) / f"rank{dist.get_rank()}.json"
        seen = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**seen, phase: peak_rss_bytes(), **values}))


def _largest(model) -> int:
    return max(p.numel() for p in model.parameters())


def paratrain_case(name: str, weights: str, tp: int, stage: int, meta_init: str = "replay") -> dict:
    import paratrain

    baseline = peak_rss_bytes()
    _reached("baseline")
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": CLIP, "optimizer": paratrain_optimizer(),
           "tensor_parallel": {"size": tp}, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
           "meta_init": meta_init}
    start = time.perf_counter()
    with paratrain.init_empty():
        model = _model(name)
    built = peak_rss_bytes()  # the meta model exists: what the first meta-device construction costs, once
    largest = _largest(model)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    init_s, init_peak = time.perf_counter() - start, peak_rss_bytes()
    _reached("init")
    local = sum(p.numel() for p in engine.module.parameters())
    dp = engine.dp_world_size
    start = time.perf_counter()
    engine.load_weights(weights)
    load_s, load_peak = time.perf_counter() - start, peak_rss_bytes()
    batches = _batches(model.config.vocab_size, engine.get_data_parallel_rank())
    losses = [float(engine.train_batch(batches)) for _ in range(STEPS)]
    return {"baseline": baseline, "built": built, "init": init_peak, "load": load_peak, "step": peak_rss_bytes(),
            "init_s": init_s, "load_s": load_s, "losses": losses, "local_params": local,
            "formula_init": _formula(baseline, local, dp, stage, largest, False),
            "formula_step": _formula(baseline, local, dp, stage, largest, True),
            "optimizer": type(engine.optimizer).__name__, "meta_init": meta_init, "setup": cfg,
            "fair": _fair(engine.optimizer, model, engine.gradient_clipping())}


DEEPSPEED_LOW_PEAK = {"sub_group_size": 10_000_000, "stage3_param_persistence_threshold": 0}


def deepspeed_case(name: str, zero: dict | None = None) -> dict:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    baseline = peak_rss_bytes()
    _reached("baseline")
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": CLIP, "steps_per_print": 10**9,
              "optimizer": deepspeed_optimizer(), "zero_optimization": {"stage": 3, **(zero or {})}}
    start = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _model(name)
    _reached("built under zero.Init")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    init_s, init_peak = time.perf_counter() - start, peak_rss_bytes()
    _reached("init")
    batches = _batches(model.config.vocab_size, dist.get_rank())
    losses = []
    for _ in range(STEPS):
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"baseline": baseline, "init": init_peak, "step": peak_rss_bytes(), "init_s": init_s, "losses": losses,
            "setup": config, "fair": _fair(engine.optimizer, model, engine.gradient_clipping())}


def fsdp2_case(name: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    baseline = peak_rss_bytes()
    start = time.perf_counter()
    with torch.device("meta"):
        model = _model(name)
    built = peak_rss_bytes()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights()  # on the DTensor shards: each rank draws only its part
    init_s, init_peak = time.perf_counter() - start, peak_rss_bytes()
    _reached("init")
    opt = torch_adamw(model.parameters())
    batches = _batches(model.config.vocab_size, dist.get_rank())
    losses = []
    for _ in range(STEPS):
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"baseline": baseline, "built": built, "init": init_peak, "step": peak_rss_bytes(), "init_s": init_s,
            "losses": losses, "setup": {"fully_shard": "each decoder layer and the root, reshard_after_forward",
                                        "optimizer": "torch AdamW fused", "init": "to_empty + init_weights"},
            "fair": _fair(opt, model, CLIP)}


def run(name: str, weights: Path, only: set[str] | None = None, repeats: int = 1) -> dict:
    """{case: [one entry per repeat: the ranks' results, or what a failed run reached]}; cases interleaved."""
    cases = {"paratrain ZeRO-3 (dp4)": (paratrain_case, (name, str(weights), 1, 3)),
             "paratrain ZeRO-3 (dp4), meta_init sharded": (paratrain_case, (name, str(weights), 1, 3, "sharded")),
             "paratrain ZeRO-1 (dp2 x tp2)": (paratrain_case, (name, str(weights), 2, 1)),
             "DeepSpeed ZeRO-3 (zero.Init), defaults": (deepspeed_case, (name,)),
             "DeepSpeed ZeRO-3 (zero.Init), sub_group_size 1e7": (deepspeed_case, (name, DEEPSPEED_LOW_PEAK)),
             "torch FSDP2 (meta init)": (fsdp2_case, (name,))}
    out: dict[str, list] = {}
    for r in range(repeats):
        for case, (fn, args) in cases.items():
            if only and not any(word in case for word in only):
                continue
            print(f"[big_init] repeat {r + 1}/{repeats}: {case}", file=sys.stderr, flush=True)
            out.setdefault(case, []).append(_one(fn, args))
    return out


def _one(fn, args) -> list | dict:
    from paratrain.testing import World, WorldError

    progress = Path(tempfile.mkdtemp(prefix="big_init_"))
    os.environ[PROGRESS_ENV] = str(progress)  # the spawned ranks inherit it
    try:  # a case that fails (a rank killed for memory, say) is recorded with what each rank reached
        with World(WORLD, timeout_s=3600) as world:
            return world.run(fn, *args)
    except WorldError as exc:
        reached = {f.stem: json.loads(f.read_text()) for f in sorted(progress.glob("rank*.json"))}
        message = str(exc)
        return {"error": message[-2000:], "reached": reached, "killed": "exit code -9" in message}
    finally:
        os.environ.pop(PROGRESS_ENV, None)
        shutil.rmtree(progress, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-350m")
    parser.add_argument("--weights", type=Path, default=None, help="where the model's safetensors file is kept")
    parser.add_argument("--only", default=None, help="comma-separated words a case's name must contain")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from paratrain.models import llama_config

    cfg = llama_config(args.model, seq_len=SEQ_LEN)
    weights = write_weights(args.model, args.weights or Path("runs") / "big_init" / f"{args.model}.safetensors")
    result = {"model": args.model, "params": cfg.num_params(), "state_bytes_fp32": 16 * cfg.num_params(),
              "world": WORLD, "steps": STEPS, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN,
              "optimizer": {"type": "AdamW", **ADAMW, "fused": FUSED}, "torch": torch.__version__,
              "command": "python -m benchmarks.big_init " + " ".join(sys.argv[1:] if argv is None else argv),
              "repeats": args.repeats,
              "cases": run(args.model, weights, set(args.only.split(",")) if args.only else None, args.repeats)}
    check_fair(result["cases"])
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()

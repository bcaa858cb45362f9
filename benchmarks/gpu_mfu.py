"""Single-device GPT training throughput and MFU through the paratrain engine (the GPU check of issue 9).

    python -m benchmarks.gpu_mfu                          # on a GPU: gpt-1.3b, bf16, seq 2048, compiled blocks
    python -m benchmarks.gpu_mfu --device cpu --preset gpt-tiny --micro-batch 4 --steps 3 --no-compile  # smoke

MFU = tokens/s x FLOPs per token / peak FLOP/s, reported under two conventions side by side
(`benchmarks/mfu.py`): the primary one, Megatron's and PaLM's, 6 x the non-embedding parameters (token and
position tables excluded) + 12·layers·d_model·seq (attention counted full, as PaLM does), and the old one,
6 x all parameters + the same attention term. The peak defaults to the dense bf16 peak of an H100/H200 SXM
(989 TFLOP/s). The run uses the engine exactly as a user would: `paratrain.initialize` with bf16 (fp32
master weights in the strategy, bf16 parameters, activations and gradients), fused AdamW and global-norm
clipping; data are random token ids already on the device, so the number measures the engine and the model,
not a data loader. On a GPU every run writes its raw JSON (model, tokens/s, peak memory, both MFUs, torch,
CUDA and driver versions, GPU name) to benchmarks/results/gpu/ unless --out says elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import paratrain
from benchmarks.mfu import H100_BF16_DENSE_TFLOPS, mfu_report
from paratrain.models import GPT, gpt_config

GPU_RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "autocast"],
                   help="bf16/fp16: the model itself in that dtype, fp32 masters in the strategy; autocast: an "
                        "fp32 model with the forward under torch.autocast(bf16) (the torch_autocast section)")
    p.add_argument("--plain", action="store_true",
                   help="the peer: the same model, data and update in a plain PyTorch loop, no paratrain engine "
                        "(--precision autocast or fp32 only: the standard AMP recipe)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile of the blocks")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                   help="the device's dense peak for --precision")
    p.add_argument("--out", default=None, help="write the result as JSON here (default on a GPU: "
                   "benchmarks/results/gpu/<preset>_<precision>[_plain].json; on the CPU: nowhere)")
    return p.parse_args(argv)


def _engine_step(model, args, batch):
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
              "bf16": {"enabled": args.precision == "bf16"}, "fp16": {"enabled": args.precision == "fp16"},
              "torch_autocast": {"enabled": args.precision == "autocast"}, "steps_per_print": 10**9}
    engine, *_ = paratrain.initialize(model=model, config=config)
    return lambda: engine.train_batch(iter([batch]))


def _plain_step(model, args, batch):
    """The peer: what a user writes without an engine (fused AdamW, clip_grad_norm_, autocast)."""
    if args.precision not in ("autocast", "fp32"):
        raise SystemExit("--plain runs --precision autocast or fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "autocast")

    def step():
        with autocast:
            loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def main(argv=None) -> dict:
    args = parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    paratrain.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    cfg = gpt_config(args.preset, seq_len=args.seq, vocab_size=args.vocab)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = GPT(cfg)
    if args.compile:
        for block in model.blocks:  # in place: module identity (and the strategies' hooks) are kept
            block.compile()
    idx = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), device=args.device)
    batch = (idx[:, :-1], idx[:, 1:])
    train_step = _plain_step(model, args, batch) if args.plain else _engine_step(model, args, batch)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times = []
    for step in range(args.warmup + args.steps):
        sync()
        tic = time.perf_counter()
        loss = train_step()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - tic)
    step_s = statistics.median(times)
    result = _result(args, cfg, step_s, float(loss))
    print(json.dumps(result, indent=1))
    out = args.out or (GPU_RESULTS / f"{args.preset}_{args.precision}{'_plain' if args.plain else ''}.json"
                       if args.device == "cuda" else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _result(args, cfg, step_s: float, last_loss: float) -> dict:
    """The raw record of one run: what ran, where, how fast, both MFU conventions."""
    tokens_per_s = args.micro_batch * cfg.seq_len / step_s
    cuda = args.device == "cuda"
    return {"runner": "plain PyTorch" if args.plain else "paratrain engine", "preset": args.preset,
            "model": {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff",
                                                   "bias")},
            "params": cfg.num_params(), "seq": cfg.seq_len, "micro_batch": args.micro_batch,
            "precision": args.precision, "compiled": args.compile, "steps": args.steps, "warmup": args.warmup,
            "median_step_s": step_s, "tokens_per_s": tokens_per_s, **mfu_report(cfg, tokens_per_s, args.peak_tflops),
            "last_loss": last_loss, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "device_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda
            else None, "python": platform.python_version(), "host_cpus": os.cpu_count(),
            "driver": _driver_version() if cuda else None, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python -m benchmarks.gpu_mfu " + " ".join(args.argv)}


def _driver_version() -> str | None:
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip().splitlines()[0] if run.returncode == 0 and run.stdout.strip() else None


if __name__ == "__main__":
    main()

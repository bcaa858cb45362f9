"""Single-device GPT training throughput and MFU through the paratrain engine (the GPU check of issue 9).

    python -m benchmarks.gpu_mfu                          # on a GPU: gpt-1.3b, bf16, seq 2048, compiled blocks
    python -m benchmarks.gpu_mfu --device cpu --preset gpt-tiny --micro-batch 4 --steps 3 --no-compile  # smoke

MFU = tokens/s x FLOPs per token / peak FLOP/s, with FLOPs per token = 6N + 12·layers·d_model·seq (PaLM's
convention: forward + backward of every weight, plus attention scores and values). The peak defaults to the
dense bf16 peak of an H100/H200 SXM (989 TFLOP/s). The run uses the engine exactly as a user would:
`paratrain.initialize` with bf16 (fp32 master weights in the strategy, bf16 parameters, activations and
gradients), fused AdamW and global-norm clipping; data are random token ids already on the device, so the
number measures the engine and the model, not a data loader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import paratrain
from paratrain.models import GPT, gpt_config


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
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense peak for --precision")
    p.add_argument("--out", default=None, help="write the result as JSON here")
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
    tokens_per_s = args.micro_batch * cfg.seq_len / step_s
    flops = tokens_per_s * cfg.flops_per_token()
    result = {"runner": "plain PyTorch" if args.plain else "paratrain engine", "preset": args.preset,
              "params": cfg.num_params(), "seq": cfg.seq_len, "micro_batch": args.micro_batch,
              "precision": args.precision, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "compiled": args.compile, "median_step_s": step_s, "tokens_per_s": tokens_per_s,
              "achieved_tflops": flops / 1e12, "peak_tflops": args.peak_tflops,
              "mfu": flops / (args.peak_tflops * 1e12), "last_loss": float(loss),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

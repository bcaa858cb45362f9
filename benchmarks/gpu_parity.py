"""Multi-rank NCCL parity: the hybrid parity matrix of tests/distributed/test_hybrid.py on N GPUs, under torchrun.

    torchrun --nproc-per-node 8 -m benchmarks.gpu_parity --out benchmarks/results/gpu/parity_8gpu.json
    torchrun --nproc-per-node 2 -m benchmarks.gpu_parity --device cpu --out /tmp/p.json   # CPU smoke (gloo)

The CPU test suite proves every layout equal to one process over gloo; a one-GPU machine only shows NCCL
with one rank, where every all-reduce is a no-op. This runs the matrix the CPU tests run (8 ranks: MATRIX_8,
4: MATRIX_4, 2: the data-, tensor-, pipeline- and context-parallel layouts of 2 ranks) with one rank per
GPU over the NCCL world paratrain builds (`cpu:gloo,cuda:nccl`), and compares every layout with the
single-process reference trained by rank 0 on its own GPU (same device kind, so the comparison measures the
parallel code, not GPU-vs-CPU rounding). Rank 0 writes every layout's worst loss, grad-norm and parameter
error; exit code 1 when any exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from paratrain.testing.parity import TOLERANCE, compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import corpus_windows, tiny_gpt
from tests.distributed.test_hybrid import MATRIX_4, MATRIX_8, STEPS, layout

MATRIX_2 = [layout(dp=2, zero=stage) for stage in (0, 1, 2, 3)] + [
    layout(tp=2, sp=True), layout(pp=2), layout(pp=2, schedule="zb-h1"), layout(cp=2),
    layout(dp=2, zero=3, ckpt="full")]
MATRICES = {2: MATRIX_2, 4: MATRIX_4, 8: MATRIX_8}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run of the script")
    p.add_argument("--tolerance", type=float, default=TOLERANCE["fp32"])
    p.add_argument("--only", type=int, default=None, help="run only the first N layouts of the matrix")
    p.add_argument("--out", default=None, help="rank 0 writes the result JSON here")
    return p.parse_args(argv)


def _on(device: torch.device):
    """The reference on rank 0's device: the model there, each global batch moved to it."""
    def make_model():
        return tiny_gpt().to(device)

    def loss_of(model, batch):
        return model(*(t.to(device) for t in batch))

    return make_model, loss_of


def _host(state: dict | None) -> dict | None:
    return None if state is None else {k: v.detach().cpu() for k, v in state.items()}


def run_matrix(configs: list[dict], device: torch.device, tolerance: float) -> list[dict]:
    """Every layout on every rank; rank 0 trains the reference and compares (others return nothing)."""
    rank, rows = dist.get_rank(), []
    make_model, loss_of = _on(device)
    for cfg in configs:
        start = time.perf_counter()
        run = run_layout(cfg, tiny_gpt, corpus_windows(), STEPS, keep_state=rank == 0)
        seconds = time.perf_counter() - start
        if rank == 0:
            run.steps[-1].state = _host(run.steps[-1].state)
            ref = reference_run(make_model, reference_config(cfg, run), corpus_windows(), STEPS, loss_of=loss_of)
            ref.state = _host(ref.state)
            summary = summarize(compare(run, ref, tolerance))
            rows.append({"case": run.case, "seconds": round(seconds, 2), "losses": run.losses, **summary})
            print(f"{run.case}: loss {summary['loss_err']:.1e} norm {summary['norm_err']:.1e} param "
                  f"{summary['param_err']:.1e} {'ok' if summary['passed'] else 'FAIL'}", flush=True)
        dist.barrier()  # the others wait while rank 0 trains the reference
    return rows


def main(argv=None) -> int:
    import paratrain

    args = parse(argv)
    paratrain.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world not in MATRICES:
        raise SystemExit(f"benchmarks.gpu_parity runs on {sorted(MATRICES)} ranks, not {world}: set torchrun's "
                         f"--nproc-per-node to one of them")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    configs = MATRICES[world][:args.only]
    rows = run_matrix(configs, device, args.tolerance)
    if dist.get_rank() != 0:
        return 0
    passed = all(r["passed"] for r in rows)
    result = {"world": world, "backend": dist.get_backend(), "device": _device_name(args.device),
              "torch": torch.__version__, "cuda": torch.version.cuda, "steps": STEPS, "tolerance": args.tolerance,
              "passed": passed, "date": time.strftime("%Y-%m-%d"), "layouts": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'PASS' if passed else 'FAIL'}: {sum(r['passed'] for r in rows)}/{len(rows)} layouts on {world} ranks "
          f"({result['backend']}) within {args.tolerance:g} of one process", flush=True)
    return 0 if passed else 1


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())

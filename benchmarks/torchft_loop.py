"""The peer of `benchmarks/fault_tolerance.py`'s recovery: torchft's own training loop, one process of one replica
group, started by torch's launcher (`python -m torch.distributed.run --max-restarts 3 benchmarks/torchft_loop.py`).

It is the loop torchft documents for fault-tolerant DDP, at its defaults: a `Manager` on a `ProcessGroupGloo`
(asynchronous quorum, the live state sent by its HTTP transport), `torchft.DistributedDataParallel` around the model,
`OptimizerWrapper` around AdamW (`zero_grad` starts the quorum, `step` applies the update only if the vote commits).
The model is paratrain's gpt-small, built as the paratrain job builds it; the rows are random tokens with this
group's seed. With `--kill-group g --kill-step s`, group g's process SIGKILLs itself after the backward of step s
(its first run only), as `fault_tolerance.inject_failure` does.

Every attempt appends a row to `<out>/group<g>.jsonl`: the step, its seconds, whether it committed, the participants,
and, on the attempt that healed this process from a peer, the seconds from the process's start to that point. torchft
does not redo a failed step: the survivors' next step trains new rows, and the failed group's rows of that step are
never trained (torchft's design). This is a benchmark helper, not paratrain's runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch


def _process_age_s() -> float:
    return time.time() - os.stat(f"/proc/{os.getpid()}").st_ctime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--kill-group", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from paratrain.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(3)
    model = build_model("gpt-small", dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    healed: list[float] = []

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        healed.append(_process_age_s())

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      min_replica_size=1, timeout=timedelta(seconds=30), replica_id=f"torchft{args.group}")
    ddp, wrapped = DistributedDataParallel(manager, model), OptimizerWrapper(manager, optimizer)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    generator = torch.Generator().manual_seed(1000 + args.group)
    vocab, seq = model.config.vocab_size, model.config.seq_len
    out = Path(args.out) / f"group{args.group}.jsonl"
    while manager.current_step() < args.steps:
        start = time.perf_counter()
        step = manager.current_step() + 1
        rows = torch.randint(0, vocab, (args.rows, seq + 1), generator=generator)
        wrapped.zero_grad()
        logits = ddp(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), rows[:, 1:].reshape(-1))
        loss.backward()
        if args.group == args.kill_group and step == args.kill_step and restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        row = {"step": step, "s": time.perf_counter() - start, "committed": committed, "restart": restart,
               "participants": manager.num_participants(), "loss": float(loss)}
        if healed:
            row["healed_s"] = healed.pop()
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

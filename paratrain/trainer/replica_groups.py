"""The job with replica groups on torchft (`fault_tolerance.enabled`; docs/fault-tolerance.md).

[Note: exact, not lossy]
Every step's global batch is R shards: shard j is what replica group j trains when all R groups are up (rows
`DataParallelSampler` gives virtual data-parallel ranks j·dp .. j·dp + dp - 1 of R·dp). Each step starts with a
torchft quorum; with P groups in it, the group of participating rank p trains the shards j with j mod P = p, one
after another in one accumulation window. So every step trains on all R shards whoever is up, and the groups' sums
(gradients, loss and token count: `engine/replicas.py`) are the whole global batch's. When a group dies during a
step, the survivors' sum fails, the commit vote says no, nothing is applied (`StepDiscarded`), and they redo the
step with the shards redistributed. A restarted group heals from a live peer's memory (`engine.live_state`: weights,
optimizer state, counters, scheduler, random generators; the data position is the step) inside its first quorum
and trains from that step on. The result differs from an uninterrupted run only in the order the shards' gradients
are added (fp32 rounding).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch

from paratrain.api import layout_label
from paratrain.config.errors import ConfigError
from paratrain.config.fault_tolerance import GROUP_ENV, LIGHTHOUSE_ENV, START_STORE_ENV, check_failure_rank
from paratrain.data.datasets import DataParallelSampler
from paratrain.engine.replicas import StepDiscarded
from paratrain.trainer.run_outputs import finish

# Test-only: seconds every group sleeps after each committed step (a tiny model's steps outrun a group's restart).
PAUSE_ENV = "PARATRAIN_TEST_STEP_PAUSE_S"


class TorchftGroups:
    """engine/replicas.py's protocol on a torchft Manager: one per rank; the ranks with the same index in every
    group form torchft's managed gloo process group, and each group's rank 0 runs its ManagerServer."""

    def __init__(self, engine, settings, group: int):
        from torchft import Manager, ProcessGroupGloo

        self.engine, self.settings, self.group = engine, settings, group
        self.kill_in_sum = False  # fault_tolerance.inject_failure: SIGKILL this rank at the step's sum
        # this group's own part of a failed attempt (gradient shards, loss sums: before the groups' sum), and the
        # part the redo adds instead of training those shards again
        self.kept: list[list[torch.Tensor] | None] = [None, None]
        self.carry: list[list[torch.Tensor]] | None = None
        self._pending: tuple[list[torch.Tensor], list] | None = None  # the gradients and their sum, until the vote
        self._started: dict[int, tuple] = {}  # index: (shard, its flat copy, the sum in flight) of `final_gradient`
        self.healed_at_step: int | None = None
        timeout = timedelta(seconds=settings.timeout_s)
        lighthouse = settings.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ConfigError("fault_tolerance needs a Lighthouse: start the job with paratrain train "
                              "--replica-groups R (it starts one), or set fault_tolerance.lighthouse")
        store = {}
        if "MASTER_ADDR" not in os.environ:  # one process, not launched: the group's store is its own
            from torch.distributed import TCPStore

            self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": "127.0.0.1", "store_port": self._store.port}
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._heal, state_dict=engine.live_state,
                min_replica_size=settings.min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=settings.quorum_timeout_s), connect_timeout=timeout,
                rank=engine.global_rank, world_size=engine.world_size, replica_id=f"replica{group}",
                lighthouse_addr=lighthouse, init_sync=False, **store)
        except RuntimeError as exc:
            raise ConfigError(f"fault_tolerance.lighthouse '{lighthouse}' did not answer within "
                              f"fault_tolerance.timeout_s ({settings.timeout_s} s): {exc}; check the address, or "
                              f"let paratrain train --replica-groups start one") from None

    def meet_at_start(self) -> None:
        """The first start of every group waits here for all of them (their ManagerServers heartbeat by now), so the
        first quorum holds every group instead of whichever started first. A restarted group goes straight on."""
        address = os.environ.get(START_STORE_ENV)
        if not address or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or self.engine.global_rank:
            return
        from torch.distributed import TCPStore

        host, port = address.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.settings.quorum_timeout_s))
        if store.add("started", 1) == self.settings.replica_groups:  # the last group to start opens the gate
            store.set("all started", "1")
        try:
            store.wait(["all started"])
        except RuntimeError:  # the store's timeout: quorum_timeout_s
            raise ConfigError(f"only {store.add('started', 0)} of {self.settings.replica_groups} replica groups "
                              f"started within fault_tolerance.quorum_timeout_s ({self.settings.quorum_timeout_s} "
                              f"s); see the other groups' logs") from None

    def _heal(self, state: dict) -> None:
        self.engine.load_live_state(state)
        self.healed_at_step = self.engine.global_steps

    def quorum(self) -> tuple[int, int]:
        """(this group's index among the step's groups, how many there are); heals this group when it is behind."""
        self.manager.start_quorum()
        self._started = {}  # an attempt that raised before its sum leaves nothing behind
        return self.manager.participating_rank(), self.manager.num_participants()

    def final_gradient(self, index: int, tensor: torch.Tensor) -> None:
        """Start one shard's sum over the groups now, beside the backward: carry added, summed in a flat copy."""
        self._add_carry([tensor], 0, [index])
        flat = tensor.detach().reshape(-1).clone()
        self._started[index] = (tensor, flat, _start_sum(self.manager, flat))

    def sum_gradients(self, tensors: list[torch.Tensor]) -> None:
        if self.kill_in_sum:  # after this step's backward: the survivors' sums (the rest, the counts) fail
            os.kill(os.getpid(), signal.SIGKILL)
        rest = [i for i in range(len(tensors)) if i not in self._started]
        self._add_carry([tensors[i] for i in rest], 0, rest)
        # summed in flat copies: the tensors keep this group's own part until the vote says what to do with it
        reduced = _reduce(self.manager, [tensors[i] for i in rest])
        for _, _, work in self._started.values():
            work.wait()
        reduced += [([t], flat) for t, flat, _ in self._started.values()]
        self._started = {}
        self._pending = (tensors, reduced)

    def sum_counts(self, sums: torch.Tensor) -> None:
        self._add_carry([sums], 1)
        self.kept[1] = [sums.detach().clone()]  # a few numbers: this group's own, for a redo's carry
        _copy_back([sums], _reduce(self.manager, [sums]))

    def _add_carry(self, tensors: list[torch.Tensor], kind: int, which: list[int] | None = None) -> None:
        """What a failed attempt of this step already trained (`carry`, gradients or sums), added in: `which` are
        the tensors' positions in the attempt's list (None: the first ones)."""
        if self.carry is not None:
            for t, i in zip(tensors, which if which is not None else range(len(tensors))):
                t.add_(self.carry[kind][i])

    def commit(self) -> bool:
        """The vote. Committed: the gradients become the groups' sum. Refused: this group's own part is kept (the
        only copy of the gradients a step makes, and only when it fails) for the redo's carry."""
        committed = self.manager.should_commit()
        tensors, reduced = self._pending
        self._pending = None
        if committed:
            _copy_back(tensors, reduced)
        else:
            self.kept[0] = [t.detach().clone() for t in tensors]
        return committed


def _start_sum(manager, flat: torch.Tensor):
    from torch.distributed import ReduceOp

    return manager.allreduce(flat, reduce_op=ReduceOp.SUM)


def _reduce(manager, tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """One managed all-reduce (sum) per dtype, of the tensors concatenated: [(those tensors, their summed flat)]."""
    out = []
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        _start_sum(manager, flat).wait()
        out.append((same, flat))
    return out


def _copy_back(tensors: list[torch.Tensor], reduced: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
    for same, flat in reduced:
        offset = 0
        for t in same:
            t.view(-1).copy_(flat[offset:offset + t.numel()])
            offset += t.numel()


class ShardRows:
    """The rows of shard j of step s for this rank: virtual data-parallel rank j·dp + d of R·dp (see the note)."""

    def __init__(self, loader, engine, groups: int):
        if not hasattr(loader, "sampler"):
            raise ConfigError("fault_tolerance needs rows it can index (data.streaming false, or the corpus)")
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.groups, self.dp, self.dp_rank = groups, engine.mesh.dims.sample_parallel_size, engine.mesh.local_rank("dp")
        self.micro, self.accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        self.seed, self.shuffle = engine.config.seed, engine.config.data.shuffle
        self.rows_per_shard = self.micro * self.dp * self.accumulation
        self._samplers: dict[int, DataParallelSampler] = {}

    def batches(self, step: int, shards: list[int]):
        for shard in shards:
            sampler = self._samplers.get(shard)
            if sampler is None:
                sampler = self._samplers[shard] = DataParallelSampler(
                    len(self.dataset), self.micro, self.groups * self.dp, shard * self.dp + self.dp_rank,
                    self.accumulation, self.seed, self.shuffle)
            epoch, within = divmod(step - 1, sampler.micro_batches_per_epoch // self.accumulation)
            if sampler.epoch != epoch:  # a new epoch's order (drawn once per epoch and shard, not per step)
                sampler.load_state_dict({"epoch": epoch, "start": 0, "position": 0, "seed": self.seed})
            sampler.position = within * self.accumulation
            for _ in range(self.accumulation):
                yield self.collate([self.dataset[i] for i in sampler.next_indices()])


def _carry_over(replicas: TorchftGroups, done: tuple[int, list[int]] | None, step: int, mine: list[int]) -> list[int]:
    """The shards to train in this attempt. A failed attempt of the same step trained some of this group's shards
    already: when this attempt's shards include all of them (and more), their kept gradients and sums are added
    instead (`TorchftGroups.carry`), and only the rest is trained (the failed step then costs the quorum's wait
    and the failed group's shards, not this group's twice)."""
    kept, replicas.kept, replicas.carry = replicas.kept, [None, None], None
    if done is None or done[0] != step or not set(done[1]) < set(mine) or None in kept:
        return mine
    replicas.carry = kept
    return [j for j in mine if j not in done[1]]


def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0)."""
    try:
        return time.time() - os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return 0.0


def _group_config(cfg, group: int):
    """Only group 0 writes checkpoints and the pretrained model: the groups hold the same state."""
    if group != 0:
        cfg.checkpoint.dir, cfg.checkpoint.save_every, cfg.trainer.save_pretrained = None, 0, None
    cfg.checkpoint.auto_resume = False  # a restarted group heals from a live peer, not from disk
    return cfg


def shards_for(groups: int, participants: int, index: int) -> list[int]:
    """The shards the group with participating rank `index` trains in a step of `participants` groups."""
    return [j for j in range(groups) if j % participants == index]


def shards_covered(groups: int, participants: int) -> set[int]:
    """Every shard some group of the step trains (all of them: the failed groups' rows are not dropped)."""
    return {j for index in range(participants) for j in shards_for(groups, participants, index)}


class _Recoveries:
    """The failed steps and what followed, as the run's summary records them."""

    def __init__(self, groups: int):
        self.groups, self.records, self._open = groups, [], None

    def failed(self, step: int, attempt_s: float, participants: int) -> None:
        if self._open is None or self._open["step"] != step:
            self._open = {"step": step, "participants_before": participants, "failed_at": time.time(),
                          "failed_attempts_s": []}
            self.records.append(self._open)
        self._open["failed_attempts_s"].append(attempt_s)

    def committed(self, step: int, attempt_s: float, participants: int, rows_per_shard: int, trained: int) -> None:
        record = self._open
        if record is None:
            return
        if record["step"] == step:  # the redone step: the shards its quorum's groups covered
            covered = len(shards_covered(self.groups, participants))
            record.update(redo_s=attempt_s, participants_after=participants, shards_trained=covered,
                          redo_shards_trained_here=trained, lost_rows=(self.groups - covered) * rows_per_shard,
                          failed_step_s=sum(record["failed_attempts_s"]) + attempt_s)
        if participants == self.groups:  # the failed group is back
            record.update(rejoined_at_step=step, degraded_s=time.time() - record["failed_at"])
            self._open = None


def train_replica_group(cfg, run_dir: str | None, steps: int, start) -> dict:
    """This process's part of the job as replica group $PARATRAIN_REPLICA_GROUP (after init_distributed); `start`:
    the job's (config, run directory) -> engine, loader, evaluator, run directory, model info."""
    started = time.time() - _process_age_s()
    group = int(os.environ.get(GROUP_ENV, "0"))
    ft = cfg.fault_tolerance
    check_failure_rank(ft.inject_failure, int(os.environ.get("WORLD_SIZE", "1")), "this group's launcher")
    engine, loader, _, out, info = start(_group_config(cfg, group), run_dir)  # the launcher's directory per group
    replicas = TorchftGroups(engine, ft, group)
    engine.join_replica_groups(replicas)
    replicas.meet_at_start()
    shards = ShardRows(loader, engine, ft.replica_groups)
    rows, recoveries, rejoin_s = _run_steps(engine, replicas, shards, steps, out,
                                            ft.replica_groups * shards.rows_per_shard * info["seq_len"])
    finish(engine, out, engine.global_steps, 0)
    layout = layout_label(engine.mesh.dims, cfg.zero_optimization.stage)
    heal = None if replicas.healed_at_step is None else {
        "healed_at_step": replicas.healed_at_step, "process_start_to_rejoin_s": rejoin_s}
    summary = {"steps": engine.global_steps, "replica_group": group, "replica_groups": ft.replica_groups,
               "first_loss": rows[0]["loss"] if rows else None, "last_loss": rows[-1]["loss"] if rows else None,
               "recoveries": recoveries, "healed": heal, "world_size": engine.world_size,
               "layout": f"{layout} in each of {ft.replica_groups} replica groups",
               "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "wall_s": time.time() - started,
               "median_step_s": statistics.median(r["step_time_s"] for r in rows) if rows else None,
               "params": info["params"], "run_dir": str(out)}
    if engine.global_rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"replica group {group}: trained to step {summary['steps']}, loss {summary['first_loss']} -> "
              f"{summary['last_loss']}, {len(recoveries)} recover(ies); run directory {out}", flush=True)
    replicas.manager.shutdown(wait=False)
    return summary


def _row(engine, step: int, loss: float, elapsed: float, tokens_per_step: int) -> dict:
    """A committed step's metrics row with the job's fields (`trainer/job.py`): `paratrain report` reads them."""
    stats = engine.comm_stats(reset=True)  # this group's, over the step's attempts
    row = {"step": step, "loss": loss, "grad_norm": engine.get_global_grad_norm(), "lr": engine.get_lr()[0],
           "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed,
           "state_bytes": engine.memory_stats()["total"],
           "comm_bytes": sum(c["bytes"] for ops in stats.values() for c in ops.values()), "comm": stats}
    row.update(engine.checkpoint_timings())
    return row


def _run_steps(engine, replicas: TorchftGroups, shards: ShardRows, steps: int, out: Path, tokens_per_step: int):
    """Every step: quorum (and healing), this group's shards, the sums and the vote; redone until committed.
    `tokens_per_step`: the global batch's (every shard's) tokens."""
    ft, gas = engine.config.fault_tolerance, engine.gradient_accumulation_steps()
    failure, restart = ft.inject_failure, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    recoveries, rows, rejoin_s = _Recoveries(ft.replica_groups), [], None
    done: tuple[int, list[int]] | None = None  # (step, shards) of a failed attempt whose own part is kept
    step_start = time.perf_counter()
    while engine.global_steps < steps:
        attempt = time.perf_counter()
        index, participants = replicas.quorum()
        if replicas.healed_at_step is not None and rejoin_s is None:
            rejoin_s = _process_age_s()  # from the restarted process's start to its first quorum's end
        step = engine.global_steps + 1
        mine = shards_for(ft.replica_groups, participants, index)
        train = _carry_over(replicas, done, step, mine)
        engine.set_accumulation(len(train) * gas)
        replicas.kill_in_sum = failure is not None and restart == 0 and failure.replica_group == replicas.group \
            and failure.at_step == step and failure.rank == engine.global_rank
        try:
            loss = float(engine.train_batch(shards.batches(step, train)))
        except StepDiscarded:
            recoveries.failed(step, time.perf_counter() - attempt, participants)
            done = (step, mine)  # what this attempt's kept part holds
            continue
        done = None
        recoveries.committed(step, time.perf_counter() - attempt, participants, shards.rows_per_shard, len(train))
        if os.environ.get(PAUSE_ENV):  # tests: steps long enough for a killed group to come back meanwhile
            time.sleep(float(os.environ[PAUSE_ENV]))
        row = _row(engine, step, loss, time.perf_counter() - step_start, tokens_per_step)
        row.update(participants=participants, shards=mine,
                   # the gradient shards whose sum over the groups started during the backward (ZeRO-3)
                   early_sums=engine.grad_sync.early_replica_sums)
        step_start = time.perf_counter()
        rows.append(row)
        if engine.global_rank == 0:  # this group's steps (a restarted group's file skips the ones it missed)
            with open(out / "metrics.jsonl", "a") as metrics:
                metrics.write(json.dumps(row) + "\n")
    engine.set_accumulation(gas)
    return rows, recoveries.records, rejoin_s

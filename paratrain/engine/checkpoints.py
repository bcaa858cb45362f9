"""The engine's checkpoints and pretrained directories (paratrain/checkpoint, docs/checkpoints.md), a part of the
engine: what it hands the checkpoint code is a `CheckpointTarget` of stateful objects (the parallel model, the
optimizer, the counters, the scheduler, the loss scaler, the random generators), never the engine."""

from __future__ import annotations

import logging
import time

import torch

from paratrain.checkpoint import CheckpointError, CheckpointTarget, load_checkpoint
from paratrain.checkpoint.adapters import Merger, merge_plan, save_adapter
from paratrain.checkpoint.async_save import CheckpointWriter, writer_axis
from paratrain.checkpoint.fingerprint import frozen_fingerprint
from paratrain.checkpoint.pretrained import save_pretrained
from paratrain.checkpoint.save import SavePlan, plan_save, stage_save, write_staged
from paratrain.engine.train_state import RandomState, TrainState
from paratrain.engine.update import OptimizerUpdate
from paratrain.layout.mesh import Mesh
from paratrain.precision import compute_dtype

log = logging.getLogger("paratrain")


class Checkpoints:
    def __init__(self, parallel, optimizer: torch.optim.Optimizer, mesh: Mesh, device: torch.device, config,
                 states: dict, random_state: RandomState, model_config, update: OptimizerUpdate):
        """`states`: the stateful objects saved once per job (train, lr_scheduler, loss_scaler; None: absent);
        `config`: the job's Config, which a checkpoint records; `update`: refuses to save what a nonfinite step
        reached."""
        self.parallel, self.optimizer, self.mesh, self.device = parallel, optimizer, mesh, device
        self.config, self.settings = config, config.checkpoint
        self.states = {name: state for name, state in states.items() if state is not None}
        self.random_state, self.model_config, self.update = random_state, model_config, update
        self.merge_peak_bytes = 0
        # checkpoint.async_save: the writes' own process group, built now (collective) on every rank
        self.writer = CheckpointWriter(writer_axis(mesh, config.comm.timeout_s)) if self.settings.async_save else None
        self.saves: list[dict] = []  # every save of this engine: tag, step, async, stall_s, write_s, staged_bytes
        self._fingerprint: dict | None = None  # the frozen base's, for asynchronous saves that leave it out
        self._plan: SavePlan | None = None  # what this rank's saves take from the live objects (save.py), kept
        self._stall_shown = self._write_shown = 0  # the saves whose stall / write time take_timings has handed out
        # a job holds its scheduled saves until the step's metrics row is written (hold_scheduled): a checkpoint
        # then never names a step whose row a kill could still lose
        self.hold_scheduled, self._held = False, False

    @property
    def train_state(self) -> TrainState:
        return self.states["train"]

    def target(self, states: bool = True, lr_scheduler: bool = True) -> CheckpointTarget:
        """The model, optimizer and stateful objects a checkpoint saves or loads (without `states`: the model
        and optimizer only)."""
        named = {name: state for name, state in self.states.items() if lr_scheduler or name != "lr_scheduler"}
        return CheckpointTarget(self.parallel, self.optimizer, self.mesh, self.config, named if states else {},
                                {"random": self.random_state} if states else {}, self.model_config)

    def save(self, save_dir, tag, client_state, save_latest: bool, exclude_frozen_parameters: bool | None) -> None:
        if exclude_frozen_parameters is None:
            exclude_frozen_parameters = self.settings.exclude_frozen_parameters
        state = self.train_state
        if state.window_micro_steps:
            raise CheckpointError(f"save_checkpoint was called in the middle of a gradient-accumulation window "
                                  f"(micro step {state.micro_steps}, {state.accumulation()} per step): "
                                  f"call it after the step that ends the window")
        tag = tag if tag is not None else f"global_step{state.global_steps}"
        self.update.check_nonfinite()  # never write parameters a NaN/inf step reached
        record = {"tag": tag, "step": state.global_steps, "async": self.writer is not None, "stall_s": None,
                  "write_s": None}
        start = time.perf_counter()
        if self.writer is not None:
            self.writer.wait()  # one save in flight: the previous one is complete (or its error raised) first
        target = self.target()
        if self._plan is None or not self._plan.holds(target, exclude_frozen_parameters):
            self._plan = plan_save(target, exclude_frozen_parameters)
        staged = stage_save(target, save_dir, tag, client_state, save_latest,
                            self._frozen_fingerprint() if exclude_frozen_parameters else None,
                            copy=self.writer is not None, plan=self._plan)
        if self.writer is None:
            write_staged(staged, self.mesh.world)
            record["write_s"] = time.perf_counter() - start
        else:
            record["staged_bytes"] = staged.bytes
            self.writer.submit(staged, record)
        record["stall_s"] = time.perf_counter() - start
        self.saves.append(record)

    def _frozen_fingerprint(self) -> dict:
        """The frozen base's fingerprint (collective at the first save that leaves the base out: every rank makes
        it), kept: frozen tensors do not change while the engine trains (a load that may change them resets it)."""
        if self._fingerprint is None:
            self._fingerprint = frozen_fingerprint(self.parallel, self.mesh)
        return self._fingerprint

    def base_changed(self) -> None:
        """The module's tensors may have been loaded anew: the next save plans again, and one that leaves the frozen
        base out fingerprints it again."""
        self._fingerprint = self._plan = None

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, and raise its error."""
        if self.writer is not None:
            self.writer.wait()

    def close(self) -> None:
        """Wait for the asynchronous save in flight, if any (raising its error), and end the writing thread."""
        if self.writer is not None:
            self.writer.close()

    def take_timings(self) -> dict[str, float]:
        """Once each: the newest save's stall (the call until training goes on) and step, and the newest finished
        write (the rank files to `latest`; an asynchronous save's once its thread is done), as checkpoint/stall_s,
        checkpoint/step and checkpoint/write_s."""
        out = {}
        fresh = self.saves[self._stall_shown:]
        if fresh:
            out["checkpoint/stall_s"] = fresh[-1]["stall_s"]
            out["checkpoint/step"] = fresh[-1]["step"]
            self._stall_shown = len(self.saves)
        # the newest save not yet shown whose write has ended (one save is in flight at a time)
        for i in range(len(self.saves) - 1, self._write_shown - 1, -1):
            if self.saves[i]["write_s"] is not None:
                out["checkpoint/write_s"] = self.saves[i]["write_s"]
                self._write_shown = i + 1
                break
        return out

    def load(self, load_dir, tag, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool):
        self.wait()  # a save in flight is complete before anything it may be writing is read
        self.base_changed()
        target = self.target(states=not load_module_only, lr_scheduler=load_lr_scheduler_states)
        return load_checkpoint(target, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states and not load_module_only)

    def save_pretrained(self, save_directory, max_shard_size: int | str, dtype, merged: bool, adapters,
                        tokenizer) -> None:
        """`adapters` and `tokenizer`: the engine's at the call (from_pretrained sets them after construction)."""
        dtype = compute_dtype(dtype) if isinstance(dtype, str) else dtype
        if adapters is not None and not merged:
            save_adapter(self.parallel, self.mesh, self.device, save_directory, adapters, dtype)
            return
        merger = Merger(merge_plan(self.parallel, self.mesh)) if adapters is not None else None
        save_pretrained(self.parallel, self.mesh, self.device, save_directory, self.model_config, tokenizer,
                        max_shard_size, dtype, merger)
        self.merge_peak_bytes = merger.peak_bytes if merger is not None else 0
        if self.mesh.rank == 0:
            log.info("saved pretrained model %s", save_directory)

    def save_if_due(self) -> None:
        every, steps = self.settings.save_every, self.train_state.global_steps
        if every and steps % every == 0:
            if self.hold_scheduled:
                self._held = True
            else:
                self.save(self.settings.dir, None, None, True, None)

    def save_held(self) -> None:
        """The scheduled save `hold_scheduled` kept back, if one is due (collective)."""
        if self._held:
            self._held = False
            self.save(self.settings.dir, None, None, True, None)

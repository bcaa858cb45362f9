"""Executing one rank's action list: forwards, backwards, weight gradients and the sends/receives between.

The runner owns nothing the engine owns: gradients land in the parameters (so the data-parallel strategy's
hooks see them), and the optimizer step stays the engine's. Before every action that produces parameter
gradients it tells the strategy whether that action is the stage's last one of the step
(`grad_sync.prepare_backward(sync=...)`), so DDP reduces each bucket once per step, as soon as its last
gradient has landed — for ZB-H1 that is the last W for Linear weights and the last B for the rest.

Memory: a micro-batch's stage input and output are dropped as soon as its B has run (its input gradient
only until the send completes); with a split backward the Linear inputs and output gradients live on until
its W.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

import paratrain.comm as comm
from paratrain.data.micro_batch import MicroBatch, in_flight, split_loss
from paratrain.errors import InvalidTypeError, InvalidValueError, RunError
from paratrain.layout.mesh import Mesh
from paratrain.parallel.pp.module import StageModule
from paratrain.parallel.pp.p2p import StageLinks, as_tensors, describe
from paratrain.parallel.pp.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    build_schedule,
)
from paratrain.parallel.pp.step_state import (
    Micro,
    StepLoss,
    StepState,
    agree_losses,
    handed_over,
    last_gradient_actions,
)
from paratrain.parallel.pp.validate import check_schedule
from paratrain.weight_grad import WeightGradDeferral


class PipelineRunner:
    """Runs one rank's schedule. Built last by `parallelize`, when everything it drives exists: `grad_sync`
    (the data-parallel strategy over the stage's parameters), `prepare_batch` (context parallelism's split of
    a micro-batch into this rank's tokens, or None) and `autocast` (the forward's autocast context factory)."""

    def __init__(self, module: StageModule, mesh: Mesh, schedule: str, micro_batches: int, virtual: int,
                 loss_fn, device: torch.device, grad_sync, prepare_batch=None, autocast=contextlib.nullcontext,
                 token_loss: bool = False, takes_documents: bool = False):
        self.module, self.mesh, self.loss_fn, self.device = module, mesh, loss_fn, device
        self.token_loss = token_loss  # loss_fn returns the mean over the targets that are not -100
        # a step's further sums to share over pp with the losses (an objective's metrics, from the last stage)
        self.step_extras: Callable[[], torch.Tensor] | None = None
        self.takes_documents = takes_documents  # some layer of the pipeline passes documents to attention
        self.grad_sync, self.prepare_batch, self.autocast = grad_sync, prepare_batch, autocast
        self.axis = mesh.axis("pp")
        self.rank = mesh.local_rank("pp")
        self.schedule = build_schedule(schedule, self.axis.size, micro_batches, virtual)
        check_schedule(self.schedule)
        self._eval_schedules: dict[int, Schedule] = {}
        self.links = StageLinks(self.axis, device)
        self.deferral = WeightGradDeferral()
        if self.schedule.split_backward:
            self.deferral.install(module)
        self.last_events: list = []
        self.last_peak_in_flight = 0
        self._shapes_known = False
        self._token_weighted: bool | None = None  # the losses' kind, read from the first step
        self.last_schedule: Schedule = self.schedule
        # NCCL wants a group's first operation to involve all its ranks; p2p batches do not.
        comm.barrier(self.axis)

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    def _chunk(self, stage: int):
        return self.module.chunks[self.schedule.chunk_of(stage)]

    def _run_chunk(self, stage: int, x, batch: MicroBatch | None = None):
        with self.autocast():
            return self._chunk(stage)(x, batch)

    # ---- one step --------------------------------------------------------------------------------
    def train_step(self, batches: list, unit: float | None = None) -> StepLoss:
        """Run one optimizer step's micro-batches (token micro-batches, or (inputs, targets) pairs); gradients
        accumulate in the stage's parameters. `unit`: backpropagate token-weighted losses as sums times it
        (`paratrain.engine.token_loss`); None: the mean over the micro-batches. Returns the step's losses, on every
        pp rank."""
        if len(batches) != self.schedule.micro_batches:
            raise InvalidValueError(f"the {self.schedule.name} schedule runs {self.schedule.micro_batches} "
                                    f"micro-batches "
                                    f"per step, got {len(batches)}")
        self._sync_actions = last_gradient_actions(self.schedule, self.rank)
        return self._run(self.schedule, batches, training=True, unit=unit)

    @torch.no_grad()
    def eval_step(self, batches: list) -> StepLoss:
        m = len(batches)
        if m not in self._eval_schedules:
            s = self.schedule
            try:
                self._eval_schedules[m] = build_schedule(s.name, s.stages, m, s.virtual, forward_only=True)
            except ScheduleError as exc:
                raise ScheduleError(f"eval_batch with {m} micro-batches: {exc} (pass num_micro_batches=...)") from None
            check_schedule(self._eval_schedules[m])
        return self._run(self._eval_schedules[m], batches, training=False)

    def _micro(self, batch) -> Micro:
        if isinstance(batch, MicroBatch):
            if batch.documents is not None and not self.takes_documents:
                raise InvalidValueError("a micro-batch with packed documents or left padding, but no layer of the "
                                        "pipeline takes `documents` to keep attention inside them: give the "
                                        "attention layers a `documents` parameter (as the built-in families have)")
            if self.prepare_batch is not None:
                batch = self.prepare_batch(batch)
            return Micro(batch.input_ids, batch.targets, batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise InvalidTypeError("in pipeline mode every micro-batch must be token data (a dict with input_ids and "
                                   "labels, or (input_ids, targets)) or a pair (inputs, targets): the first stage "
                                   "consumes the inputs, the last stage the targets")
        if self.prepare_batch is not None:
            raise InvalidTypeError("context parallelism with a pipeline splits token data only: feed (b, s) token ids "
                                   "with targets, or a dict with input_ids and labels")
        return Micro(batch[0], batch[1])

    def _run(self, schedule: Schedule, batches: list, training: bool, unit: float | None = None) -> StepLoss:
        micros = [self._micro(b) for b in batches]
        if not self._shapes_known:
            self._learn_shapes(micros[0])
        step = StepState(micros, training, unit)
        actions = schedule.actions[self.rank]
        wall0, clock0 = time.time(), time.perf_counter()
        j = 0
        while j < len(actions):
            if actions[j].is_comm:
                k = j
                while k < len(actions) and actions[k].is_comm:
                    k += 1
                self._communicate(schedule, actions[j:k], step)
                j = k
                continue
            a = actions[j]
            self._wait_for_inputs(schedule, a, step)  # waiting is idle time, not part of the action
            start = time.perf_counter()
            if a.kind == F:
                self._forward(schedule, a, step)
            elif a.kind == B:
                self._backward(schedule, a, step)
            else:
                self._weight(a)
            end = time.perf_counter()
            step.events.append((a.kind.value, a.stage, a.micro, wall0 + start - clock0, wall0 + end - clock0))
            j += 1
        self.links.wait_sends()
        if step.leftovers() or self.deferral.pending():  # every activation must be gone by now
            raise RunError(f"pipeline step ended holding {step.leftovers()} and {self.deferral.pending()} "
                           f"pending weight gradients; the schedule is not complete")
        if training:  # the timeline shows the last training step (an evaluation does not replace it)
            self.last_events, self.last_schedule = step.events, schedule
            self.last_peak_in_flight = step.peak_in_flight
        return self._step_loss(step.losses)

    def _step_loss(self, losses: list) -> StepLoss:
        """The step's losses on every pp rank (`step_state.agree_losses`); the kind is read in the first step."""
        extra = self.step_extras() if self.step_extras is not None else None
        loss = agree_losses(losses, self.axis, self.device, self._token_weighted, extra)
        self._token_weighted = loss.token_weighted
        return loss

    def _learn_shapes(self, first: Micro) -> None:
        was_training = self.module.training
        self.module.eval()  # no dropout, no buffer updates
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            self.links.learn_shapes(self.module.stages, self.num_stages, self.schedule.rank_of,
                                    lambda stage, x: self._run_chunk(stage, x, first.batch), first.inputs)
        self.module.train(was_training)
        self._shapes_known = True

    def gather_timeline(self) -> dict:
        """The last step's events of every rank (collective over the world); see pipeline.timeline."""
        from paratrain.parallel.pp.timeline import gather_timeline

        return gather_timeline(self)

    # ---- actions ---------------------------------------------------------------------------------
    def _communicate(self, schedule: Schedule, batch: list[Action], step: StepState) -> None:
        """Post one gap of the schedule as one batch (sends, then receives, in action order)."""
        sends, recvs, recv_actions = [], [], []
        for a in batch:
            key, peer = (a.stage, a.micro), schedule.rank_of(a.peer_stage)
            if a.kind == SEND_F:
                value = step.outputs[key] if step.training else step.outputs.pop(key)
                self.links.check_sent(a.stage, value)
                sends.append((value, peer))
            elif a.kind == SEND_B:
                sends.append((step.input_grads.pop(key), peer))
            elif a.kind == RECV_F:
                recvs.append((self.links.known[a.stage], peer))
                recv_actions.append(a)
            elif a.kind == RECV_B:  # gradients of this stage's floating-point outputs, shaped like them
                floats = [t for t in as_tensors(step.outputs[key]) if t.is_floating_point()]
                recvs.append((describe(tuple(floats)), peer))
                recv_actions.append(a)
        for a, incoming in zip(recv_actions, self.links.post(sends, recvs)):
            step.incoming[a] = incoming

    def _wait_for_inputs(self, schedule: Schedule, a: Action, step: StepState) -> None:
        if a.kind == F and a.stage > 0 and not schedule.local(a.stage, a.stage - 1):
            step.incoming[Action(RECV_F, a.stage, a.micro)].wait()
        elif a.kind == B and a.stage < schedule.num_stages - 1 and not schedule.local(a.stage, a.stage + 1):
            step.incoming[Action(RECV_B, a.stage, a.micro)].wait()

    def _forward(self, schedule: Schedule, a: Action, step: StepState) -> None:
        key = (a.stage, a.micro)
        micro = step.batches[a.micro]
        if a.stage == 0:
            x = micro.inputs
        elif schedule.local(a.stage, a.stage - 1):  # the bottom of a V: this rank's own previous stage
            previous = (a.stage - 1, a.micro)
            x = handed_over(step.outputs[previous] if step.training else step.outputs.pop(previous), step.training)
        else:
            incoming = step.incoming.pop(Action(RECV_F, a.stage, a.micro))
            tensors = incoming.wait()
            if step.training:
                tensors = [t.requires_grad_() if t.is_floating_point() else t for t in tensors]
            x = tuple(tensors) if incoming.is_tuple else tensors[0]
        out = self._run_chunk(a.stage, x, micro.batch)
        if a.stage == schedule.num_stages - 1:
            with self.autocast(), in_flight(micro.batch):
                loss = self.loss_fn(out, micro.targets)
            out = self._weighted(loss, micro, step, schedule.micro_batches)
        if step.training:
            step.inputs[key] = x
            step.outputs[key] = out
            step.peak_in_flight = max(step.peak_in_flight, len(step.outputs))
        elif a.stage < schedule.num_stages - 1:
            step.outputs[key] = out

    def _weighted(self, loss, micro: Micro, step: StepState, count: int) -> torch.Tensor:
        """Record the micro-batch's loss and return what backward differentiates: the loss sum times the unit
        when token-weighted (a loss_fn's own (sum, count), or a mean over target tokens), else the mean over
        the step's micro-batches."""
        parts = split_loss(loss)
        if parts is None and self.token_loss and micro.batch is not None and micro.targets is not None:
            tokens = micro.batch.valid_tokens()
            parts = (loss * tokens, tokens)
        if parts is None:
            step.losses.append((loss.detach(), torch.ones(()), False))
            return loss / count
        total, tokens = parts
        step.losses.append((total.detach(), tokens, True))
        if step.training and step.unit is None:
            raise RunError("a token-weighted pipeline loss without the backprop unit; run steps through the engine")
        return total * step.unit if step.training else total

    def _backward(self, schedule: Schedule, a: Action, step: StepState) -> None:
        key = (a.stage, a.micro)
        out, x = step.outputs.pop(key), step.inputs.pop(key)
        if a.stage == schedule.num_stages - 1:
            roots, grads = [out], [None]
        else:
            incoming = step.input_grads.pop((a.stage + 1, a.micro)) if schedule.local(a.stage, a.stage + 1) else \
                step.incoming.pop(Action(RECV_B, a.stage, a.micro)).wait()
            floats = [t for t in as_tensors(out) if t.is_floating_point()]
            pairs = [(t, g) for t, g in zip(floats, incoming) if t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        self.grad_sync.prepare_backward(sync=a in self._sync_actions)
        self.deferral.key = key
        try:
            if roots:
                torch.autograd.backward(roots, grads)
        finally:
            self.deferral.key = None
        if a.stage > 0:
            step.input_grads[key] = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                          for t in as_tensors(x) if t.is_floating_point())

    def _weight(self, a: Action) -> None:
        weights, grads = self.deferral.pop((a.stage, a.micro))
        self.grad_sync.prepare_backward(sync=a in self._sync_actions)
        if weights:
            torch.autograd.backward(weights, grads)


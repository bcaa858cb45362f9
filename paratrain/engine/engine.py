"""The training engine: DeepSpeed's forward / backward / step contract over any parallel layout.

    engine, optimizer, loader, scheduler = paratrain.initialize(model=model, config="ds_config.json")
    for batch in loader:                 # or: loss = engine.train_batch()
        loss = engine(*batch)
        engine.backward(loss)            # scales by 1/gradient_accumulation_steps
        engine.step()                    # steps the optimizer only at the accumulation boundary

The engine knows strategies only through `parallelize`: gradient synchronization, sharding and the update
belong to the `GradSync` it returns. Its own state is a `TrainState` (counters, data position) and a
`RandomState`; checkpoints receive those with the model, optimizer, scheduler and loss scaler as stateful
objects (`CheckpointTarget`), never the engine. The DeepSpeed accessors (`engine/deepspeed_api.py`) only read it.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

from paratrain.adapters.tensors import adapter_tensors
from paratrain.comm import gather_from_region
from paratrain.config import Config
from paratrain.data.agreement import FIRST_STEPS, check_same_batches
from paratrain.data.batch_check import BatchChecker
from paratrain.data.micro_batch import MicroBatch, as_micro_batch, in_flight, loss_of_output, split_loss
from paratrain.data.nested import to_device
from paratrain.distributed import current_device
from paratrain.engine.adapters import adapted_model
from paratrain.engine.checkpoints import EngineCheckpoints
from paratrain.engine.deepspeed_api import DeepSpeedEngineAPI
from paratrain.engine.evaluation import Evaluation
from paratrain.engine.generation import Generation
from paratrain.engine.monitor import MonitorSettings, StepReporter, setup_logging
from paratrain.engine.muon_setup import bind_muon, muon_param_groups
from paratrain.engine.objective_step import ObjectiveStep
from paratrain.engine.pipeline_steps import PipelineSteps
from paratrain.engine.setup import (
    local_param_groups,
    make_loader,
    make_scheduler,
    named_param_groups,
    optimizer_factory,
)
from paratrain.engine.strategies import strategies_of
from paratrain.engine.token_loss import LossWindow
from paratrain.engine.train_state import RandomState, TrainState
from paratrain.engine.update import OptimizerUpdate
from paratrain.errors import InvalidValueError, RunError
from paratrain.init.replay import return_freed_heap, template_of
from paratrain.layout.mesh import Mesh
from paratrain.objectives import NextToken, Objective, build_objective
from paratrain.parallel.parallelize import parallelize
from paratrain.precision import make_loss_scaler

log = logging.getLogger("paratrain")


class Engine(EngineCheckpoints, PipelineSteps, Evaluation, Generation, DeepSpeedEngineAPI):
    """DeepSpeed's engine contract. Construction helpers live in `engine/setup.py`, the update in `engine/update.py`,
    pipeline steps in `engine/pipeline_steps.py`, the token loss's bookkeeping in `engine/token_loss.py`,
    checkpoints and pretrained directories in `engine/checkpoints.py`, the read-only accessors (DeepSpeed's and
    paratrain's introspection) in `engine/deepspeed_api.py`."""

    def __init__(self, model: nn.Module, config: Config, mesh: Mesh, optimizer=None, lr_scheduler=None,
                 model_parameters=None, training_data=None, collate_fn=None, init_fn=None, objective=None):
        self.config = config
        self.mesh = mesh  # the explicit mesh every strategy was given (axes, comm stats, guard)
        self.destroyed = False
        setup_logging(mesh.rank)
        if mesh.guard is not None:  # every collective below waits at most comm.timeout_s, then reports
            mesh.guard.configure(timeout_s=config.comm.timeout_s, report_dir=config.comm.report_dir or ".")
        self.device = current_device()
        # A transformers model's layered view (same names); its adapters (LoRA, DoRA: a peft model's or the config's)
        model, self.adapters, self.model_config = adapted_model(model, config)
        self._adapter_tensors = adapter_tensors(model)  # names and full shapes, before anything splits them
        self.tokenizer = None  # from_pretrained's, when the model directory has one; save_pretrained saves it
        template = template_of(model)  # a meta model's structure, before parallelize changes it
        factory = optimizer_factory(config, optimizer)  # (its refusals come before any collective)
        groups = named_param_groups(model, model_parameters)  # by name: tensor parallelism replaces parameters
        groups = muon_param_groups(model, config, groups, optimizer)  # Muon's halves (other optimizers: as given)
        objective = objective if objective is not None else build_objective(config.objective)
        reference_mode, reference_source = self._reference_source(model, objective)
        self.parallel = parallelize(model, mesh, strategies_of(config), device=self.device)
        self.module = self.parallel.module
        self.grad_sync = self.parallel.grad_sync
        self.pipeline = self.parallel.pipeline  # set when pipeline.stages > 1: whole steps only
        self._autocast = self.parallel.autocast
        self.optimizer = self.grad_sync.build_optimizer(factory,
                                                        local_param_groups(groups, self.parallel,
                                                                           self.grad_sync.named_params))
        bind_muon(self.optimizer, self.grad_sync, mesh, self.device)
        self.lr_scheduler = make_scheduler(config, self.optimizer, lr_scheduler)
        if template is not None:  # the local state is allocated, not yet written: trim before the writes peak
            return_freed_heap()
        self._fill_initial_values(template, init_fn)  # load_weights, a meta model's init; adapters without values
        self.objective = None if reference_mode is None else ObjectiveStep.build(
            objective, self.parallel, mesh, self.device, reference_mode, reference_source, strategies_of(config))
        self._fill_reference(template, init_fn)  # the frozen copy's initial values, as the policy's
        self._objective_metrics: torch.Tensor | None = None  # the last step's reduced metric sums
        self.training_dataloader = make_loader(self, training_data, collate_fn) if training_data is not None \
            else None
        sampler = self.training_dataloader.sampler if self.training_dataloader is not None else None
        # (not a bound method of the engine: a cycle would keep a finished engine and its groups alive until gc)
        self.train_state = TrainState(lambda: config.gradient_accumulation_steps, sampler)
        self.random_state = RandomState(self.parallel.random_streams, {"sizes": mesh.dims.layout(),
                                                                       "coords": dict(mesh.coords)})
        self.loss_scaler = make_loss_scaler(config.fp16)  # fp16 only
        self._update = OptimizerUpdate(self.grad_sync, mesh, self.device, self.loss_scaler, config.nonfinite_loss,
                                       check_every=config.steps_per_print)
        self._grad_norm: torch.Tensor | None = None
        # "token" reduction: each window's losses and target counts, divided by the global count at the boundary
        self._window = LossWindow(mesh.axis("dp_cp"), self.device, token_loss=config.loss.reduction == "token"
                                  and self.parallel.spec.loss_is_token_mean(self.module))
        self._last_batch: MicroBatch | None = None  # the token micro-batch of the last forward, for its count
        self._window_loss: torch.Tensor | None = None  # the last window's global token mean
        self._times: dict[str, float] = defaultdict(float)
        self._step_applied = False
        self._reporter = StepReporter(MonitorSettings.of(config), mesh.rank, self.module, mesh.axis("dp_cp"))
        self.monitor = self._reporter.monitor  # DeepSpeed's engine.monitor (write_events, enabled, close)
        self._check_train_batch = BatchChecker(config.batch_check, "training")
        self._check_eval_batch = BatchChecker(config.batch_check, "evaluation")
        self.auto_resumed: tuple[str, dict] | None = None  # (path, client_state) when initialize() resumed

    def _reference_source(self, model: nn.Module, objective: Objective) -> tuple[str | None, nn.Module | None]:
        """(where the objective's reference comes from, the frozen copy an "initial" reference is built from);
        (None, None) for next-token cross-entropy, which the model's own fused loss computes. Taken before
        parallelize changes the model."""
        if isinstance(objective, NextToken):
            return None, None
        settings = self.config.objective
        mode = ObjectiveStep.reference_mode(objective, settings.reference, self.adapters is not None,
                                            settings.reference_model)
        return mode, ObjectiveStep.frozen_copy(model) if mode == "initial" else None

    # ---- state of the step ----------------------------------------------------------------------
    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @contextmanager
    def no_sync(self):
        """Skip gradient synchronization for the backwards inside (the user accumulates by hand)."""
        with self.grad_sync.no_sync():
            yield

    # ---- the step contract -----------------------------------------------------------------------
    @contextmanager
    def _timed(self, name: str):
        if self.destroyed:  # every forward, backward, step and pipeline step passes here
            raise RunError(f"engine.{name}: engine.destroy() was called, which freed its process groups; "
                           f"build a new engine with paratrain.initialize")
        start = time.perf_counter()
        try:
            with self._together():
                yield
        finally:
            self._times[name] += time.perf_counter() - start

    @contextmanager
    def _together(self):
        """An error raised here on one rank is published for the others, which stop at their next wait instead
        of at the communication timeout (`comm/guard.py`)."""
        try:
            yield
        except Exception as exc:
            if self.mesh.guard is not None:
                self.mesh.guard.publish_failure(exc)
            raise

    def _not_in_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise RunError(f"engine.{what} is not available with pipeline.stages > 1: a pipeline runs whole "
                           f"steps of micro-batches; call engine.train_batch(data_iter) or "
                           f"engine.eval_batch(data_iter) (DeepSpeed's PipelineEngine does the same)")

    def forward(self, *inputs, **kwargs):
        """Token data (ids with targets, transformers' `labels`, `attention_mask`, packing) is brought to the
        normal form (`paratrain.data.micro_batch`), split for context parallelism, and given to the model by its
        spec; anything else goes to the model as it is."""
        self._not_in_pipeline("forward()")
        return self._forward(as_micro_batch(inputs, kwargs), inputs, kwargs)

    __call__ = forward

    def _forward(self, batch: MicroBatch | None, inputs: tuple, kwargs: dict):
        """Run token data (`batch`, already on the device) through the model's spec, anything else as given."""
        self._last_batch = None
        with self._timed("forward"), self._autocast():
            self._check_agreement([batch if batch is not None else (inputs, kwargs)])
            if batch is None:
                self.parallel.check_unsplit(inputs, kwargs)
                return self.module(*inputs, **kwargs)
            if batch.targets is None:  # the model's outputs (logits): whole, never this rank's slice unsaid
                return self._whole_outputs(batch)
            batch = self.parallel.prepare_batch(batch)
            if self.objective is not None:  # the reference log-probs the batch lacks, on the same split
                self.objective.prepare(batch)
            self._last_batch = batch
            with in_flight(batch):
                return self.parallel.spec.call(self.module, batch)

    def _whole_outputs(self, batch: MicroBatch):
        """A forward without targets returns the logits over the whole vocabulary (gathered over tp, with the
        gradient going back to each rank's slice); under context parallelism it is refused by name: each rank
        holds a chunk of the sequence, and a loss of the user's over gathered chunks would be counted cp times."""
        if self.parallel.context is not None:
            raise RunError("engine(...) without targets under context parallelism would return this rank's chunk of "
                           "the sequence only: give the targets (labels=, or (input_ids, targets)) and let the engine "
                           "compute the loss, or train your own loss as an objective on exact per-token log-probs "
                           "(the `objective` section, docs/objectives.md), which is exact under every split")
        out = self.parallel.spec.call(self.module, batch)
        vocab = self._vocab_parallel_loss()
        if vocab is None or not isinstance(out, torch.Tensor) or out.shape[-1] != vocab.local_vocab:
            return out
        return gather_from_region(out, vocab.axis, dim=-1, tag="logits")[..., :vocab.vocab_size]

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """`loss`: the forward's scalar loss, or a model's `(sum, count)`. Under the "token" reduction a loss
        paratrain knows to be a mean over target tokens is backpropagated as their sum (`engine/token_loss.py`)."""
        self._not_in_pipeline("backward()")
        scaled = self._weighted(loss, scale_wrt_gas)
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        self.grad_sync.prepare_backward(sync=self.is_gradient_accumulation_boundary())
        with self._timed("backward"):
            scaled.backward(retain_graph=retain_graph)

    def _weighted(self, loss, scale_wrt_gas: bool) -> torch.Tensor:
        """The micro-batch's loss as backward differentiates it, recorded in the window (`engine/token_loss.py`)."""
        batch, self._last_batch = self._last_batch, None
        scaled, token = self._window.weigh(loss, batch, self.gradient_accumulation_steps(), scale_wrt_gas)
        if not token:
            self._reporter.record_loss(loss)
        return scaled

    def step(self) -> None:
        """Called after every backward; updates the model only at the accumulation boundary."""
        self._not_in_pipeline("step()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with self._timed("step"):
                self._optimizer_update()
        else:
            self._step_applied = False
        state = self.train_state
        state.micro_steps += 1
        state.window_micro_steps = 0 if boundary else state.window_micro_steps + 1
        state.global_samples += self.train_micro_batch_size_per_gpu() * self.mesh.size("dp")
        if boundary:
            self._reporter.after_step(self)
            self._save_if_due()

    def _optimizer_update(self, grad_scale: torch.Tensor | float = 1.0) -> None:
        """Update once (the same branch on every rank: the norm is the same number everywhere); a skipped
        step still counts (DeepSpeed's behaviour on an fp16 overflow). `grad_scale`: the token-weighted
        loss's division by the global count (`engine/token_loss.py`)."""
        with self._timed("comm_wait"):
            self.grad_sync.finish_gradients()
        if self._window.token_weighted:  # the one count exchange of the step (engine/token_loss.py)
            extra = self.objective.take_metrics() if self.objective is not None else None
            self._window_loss, grad_scale, self._objective_metrics = self._window.finish(extra)
            self._reporter.record_loss(self._window_loss)
        self._window.reset()
        state = self.train_state
        update = self._update(self.lr_scheduler, self.gradient_clipping(), state.global_steps + 1, grad_scale)
        self._grad_norm = update.norm
        self._step_applied = update.skipped is None
        state.global_steps += 1
        if update.skipped is not None:
            state.skipped_steps += 1
            if self.global_rank == 0:
                log.warning("step %d skipped: %s (skipped_steps=%d)", state.global_steps, update.skipped,
                            state.skipped_steps)

    def _run_micro_batch(self, batch) -> torch.Tensor:
        (self._check_train_batch if self.module.training else self._check_eval_batch)(batch)
        inputs, kwargs = ((), batch) if isinstance(batch, dict) else \
            (tuple(batch), {}) if isinstance(batch, (tuple, list)) else ((batch,), {})
        token = as_micro_batch(inputs, kwargs)  # from the loader's tensors, before the copy (token_layout's note)
        if token is not None:
            out = self._forward(token.to(self.device), (), {})
        else:
            inputs, kwargs = to_device((inputs, kwargs), self.device)
            out = self._forward(None, inputs, kwargs)
        return out if split_loss(out) is not None else loss_of_output(out)

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one global batch (every micro-batch of this rank), step, and return the global mean loss."""
        with self._together():
            return self._train_batch(data_iter)

    def _train_batch(self, data_iter=None) -> torch.Tensor:
        if data_iter is None:
            if self.training_dataloader is None:
                raise InvalidValueError("train_batch() needs data_iter= or training_data= passed to initialize()")
            data_iter = self.training_dataloader
        if self.pipeline is not None:
            return self._train_pipeline(data_iter)
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # no host sync per micro-batch
        self._window_loss = None
        for _ in range(self.gradient_accumulation_steps()):
            loss = self._run_micro_batch(next(data_iter))
            self.backward(loss)
            self.step()
            if self._window_loss is None and split_loss(loss) is None:  # (a (sum, count): the window's)
                total += loss.detach().float()
        if self._window_loss is not None:  # token-weighted: the step's all-reduce already gave the global mean
            return self._window_loss
        return self._mean_over_dp(total / self.gradient_accumulation_steps())

    def _check_agreement(self, batches: list) -> None:
        """The peers of this replica hold the same micro-batches (`data/agreement.py`): first steps, or always."""
        mode = self.config.batch_agreement
        if mode == "every_step" or (mode == "first_steps" and self.train_state.global_steps < FIRST_STEPS):
            check_same_batches(batches, self.mesh, self.train_state.global_steps + 1, self.device)

    # ---- changing the engine's state -----------------------------------------------------------
    def set_accumulation(self, steps: int) -> None:
        """Accumulate `steps` micro-batches per optimizer step from the next window on (between windows only:
        engine.set_train_batch_size checks and calls it)."""
        if self.train_state.window_micro_steps:
            raise InvalidValueError("the number of accumulated micro-batches can only change between accumulation "
                                    "windows: call it after engine.step() has updated the model")
        self.config.gradient_accumulation_steps = steps
        self.config.train_batch_size = steps * self.train_micro_batch_size_per_gpu() * self.dp_world_size

    def objective_metrics(self) -> dict[str, float]:
        """The last optimizer step's objective metrics over the global batch (TRL's names: rewards/chosen,
        rewards/accuracies, clip_ratio/region_mean, kl, entropy, ...); one host read. Empty for next-token loss."""
        if self.objective is None or self._objective_metrics is None:
            return {}
        return self.objective.metrics.values(self._objective_metrics)

    def destroy(self) -> None:
        """Free the engine's process groups and close its monitors (the W&B / MLflow runs finish), as DeepSpeed's
        engine.destroy releases its resources. Collective: call on every rank; afterwards it cannot train."""
        self.monitor.close()
        if self.objective is not None:
            self.objective.destroy()
        self.mesh.destroy()
        self.destroyed = True


"""The training engine: DeepSpeed's forward / backward / step contract over any parallel layout.

    engine, optimizer, loader, scheduler = paratrain.initialize(model=model, config="ds_config.json")
    for batch in loader:                 # or: loss = engine.train_batch()
        loss = engine(*batch)
        engine.backward(loss)            # scales by 1/gradient_accumulation_steps
        engine.step()                    # steps the optimizer only at the accumulation boundary

The engine knows strategies only through `parallelize`: gradient synchronization, sharding and the update
belong to the `GradSync` it returns. Its own state is a `TrainState` (counters, data position) and a
`RandomState`. It is composed of parts, each given what it uses when it is built (docs/architecture.md):

    ForwardPass      a micro-batch through the model in its layout          engine/forward_pass.py
    ObjectiveStep    the objective's head, reference and metrics            engine/objective_step.py
    LossWindow       the step's token-weighted loss and its one all-reduce  engine/token_loss.py
    OptimizerUpdate  gradients finished, clipped, the optimizer stepped     engine/update.py
    Checkpoints      checkpoints and pretrained directories                 engine/checkpoints.py
    Evaluator        eval_batch and evaluate                                engine/evaluation.py
    Generator        generate                                               engine/generation.py
    StepReporter     the monitors' lines and scalars                        engine/monitor.py
    Phases           each phase's seconds, destroy, failures shared         engine/phases.py

The engine keeps the step contract (forward, backward, step, train_batch, the pipeline's whole steps) and
DeepSpeed's surface: the accessors it inherits (`engine/deepspeed_api.py`) only read its state.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from paratrain.adapters.tensors import adapter_tensors
from paratrain.config import Config
from paratrain.data.micro_batch import as_micro_batch, split_loss
from paratrain.distributed import current_device
from paratrain.engine.adapters import adapted_model
from paratrain.engine.checkpoint_api import CheckpointAPI
from paratrain.engine.checkpoints import Checkpoints
from paratrain.engine.deepspeed_api import DeepSpeedEngineAPI, check_eval_arguments
from paratrain.engine.evaluation import Evaluator
from paratrain.engine.forward_pass import ForwardPass
from paratrain.engine.generation import Generator
from paratrain.engine.monitor import MonitorSettings, StepReporter, setup_logging
from paratrain.engine.muon_setup import bind_muon, muon_param_groups
from paratrain.engine.objective_step import ObjectiveStep
from paratrain.engine.phases import Phases
from paratrain.engine.replicas import ReplicaGroups, StepDiscarded
from paratrain.engine.setup import (
    local_param_groups,
    make_loader,
    make_scheduler,
    named_param_groups,
    optimizer_factory,
)
from paratrain.engine.strategies import strategies_of
from paratrain.engine.token_loss import LossWindow, mean_over_ranks, target_positions
from paratrain.engine.train_state import RandomState, TrainState
from paratrain.engine.update import OptimizerUpdate
from paratrain.engine.weights import fill_initial_values, fill_reference
from paratrain.errors import InvalidValueError, RunError
from paratrain.generation import GenerationSettings, Rollout
from paratrain.init.replay import return_freed_heap, template_of
from paratrain.layout.mesh import Mesh
from paratrain.objectives import NextToken, Objective, build_objective
from paratrain.parallel.parallelize import parallelize
from paratrain.precision import make_loss_scaler

log = logging.getLogger("paratrain")


class Engine(DeepSpeedEngineAPI, CheckpointAPI):
    """DeepSpeed's engine contract over the parts the module docstring lists. Construction helpers live in
    `engine/setup.py`; DeepSpeed's read-only accessors and paratrain's introspection in `engine/deepspeed_api.py`."""

    def __init__(self, model: nn.Module, config: Config, mesh: Mesh, optimizer=None, lr_scheduler=None,
                 model_parameters=None, training_data=None, collate_fn=None, init_fn=None, objective=None):
        self.config = config
        self.mesh = mesh  # the explicit mesh every strategy was given (axes, comm stats, guard)
        setup_logging(mesh.rank)
        if mesh.guard is not None:  # every collective below waits at most comm.timeout_s, then reports
            mesh.guard.configure(timeout_s=config.comm.timeout_s, report_dir=config.comm.report_dir or ".")
        self._phases = Phases(mesh.guard)
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
        self.optimizer = self.grad_sync.build_optimizer(factory,
                                                        local_param_groups(groups, self.parallel,
                                                                           self.grad_sync.named_params))
        bind_muon(self.optimizer, self.grad_sync, mesh, self.device)
        self.lr_scheduler = make_scheduler(config, self.optimizer, lr_scheduler)
        if template is not None:  # the local state is allocated, not yet written: trim before the writes peak
            return_freed_heap()
        # load_weights, a meta model's init; adapters without values
        fill_initial_values(self.parallel, mesh, config, template, init_fn, self.adapters, self._adapter_tensors)
        self.objective = None if reference_mode is None else ObjectiveStep.build(
            objective, self.parallel, mesh, self.device, reference_mode, reference_source, strategies_of(config))
        if self.objective is not None and self.objective.reference is not None:  # the policy's initial values
            fill_reference(self.objective.reference, mesh, config, template, init_fn, self._adapter_tensors)
        self._objective_metrics: torch.Tensor | None = None  # the last step's reduced metric sums
        self._build_parts(training_data, collate_fn)

    def _build_parts(self, training_data, collate_fn) -> None:
        """The step's state and the parts that share it, each given what it uses."""
        config, mesh = self.config, self.mesh
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
        self._window_loss: torch.Tensor | None = None  # the last window's global token mean
        self.replica_groups: ReplicaGroups | None = None  # fault tolerance: `join_replica_groups`
        self._step_applied = False
        self._reporter = StepReporter(MonitorSettings.of(config), mesh.rank, self.module, mesh.axis("dp_cp"))
        self.monitor = self._reporter.monitor  # DeepSpeed's engine.monitor (write_events, enabled, close)
        self._forward = ForwardPass(self.parallel, self.objective, mesh, self.device, config.batch_check,
                                    config.batch_agreement, self.train_state, self._phases)
        self._checkpoints = Checkpoints(self.parallel, self.optimizer, mesh, self.device, config,
                                        {"train": self.train_state, "lr_scheduler": self.lr_scheduler,
                                         "loss_scaler": self.loss_scaler}, self.random_state, self.model_config,
                                        self._update)
        loader_collate = getattr(self.training_dataloader, "collate_fn", None)
        self._evaluator = Evaluator(self._forward, self.objective, self._window, mesh, self.device, self._phases,
                                    self.train_state.accumulation, config.train_micro_batch_size_per_gpu,
                                    loader_collate)
        self._generator = Generator(self.parallel, mesh, self.device, config.tensor_parallel.sequence_parallel,
                                    self._phases)
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
    @property
    def destroyed(self) -> bool:
        return self._phases.destroyed

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
    def _not_in_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise RunError(f"engine.{what} is not available with pipeline.stages > 1: a pipeline runs whole "
                           f"steps of micro-batches; call engine.train_batch(data_iter) or "
                           f"engine.eval_batch(data_iter) (DeepSpeed's PipelineEngine does the same)")

    def forward(self, *inputs, **kwargs):
        """Token data (ids with targets, transformers' `labels`, `attention_mask`, packing) is brought to the
        normal form (`paratrain.data.micro_batch`), split for context parallelism, and given to the model by its
        spec; anything else goes to the model as it is (`engine/forward_pass.py`). Without targets under tp the
        logits are the whole vocabulary's; under cp that is refused by name."""
        self._not_in_pipeline("forward()")
        return self._forward(as_micro_batch(inputs, kwargs), inputs, kwargs)

    __call__ = forward

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """`loss`: the forward's scalar loss, or a model's `(sum, count)`. Under the "token" reduction a loss
        paratrain knows to be a mean over target tokens is backpropagated as their sum (`engine/token_loss.py`)."""
        self._not_in_pipeline("backward()")
        scaled = self._weighted(loss, scale_wrt_gas)
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        self.grad_sync.prepare_backward(sync=self.is_gradient_accumulation_boundary())
        with self._phases.timed("backward"):
            scaled.backward(retain_graph=retain_graph)

    def _weighted(self, loss, scale_wrt_gas: bool) -> torch.Tensor:
        """The micro-batch's loss as backward differentiates it, recorded in the window (`engine/token_loss.py`)."""
        batch = self._forward.take_last()
        scaled, token = self._window.weigh(loss, batch, self.gradient_accumulation_steps(), scale_wrt_gas)
        if not token:
            self._reporter.record_loss(loss)
        return scaled

    def step(self) -> None:
        """Called after every backward; updates the model only at the accumulation boundary."""
        self._not_in_pipeline("step()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with self._phases.timed("step"):
                self._optimizer_update()
        else:
            self._step_applied = False
        state = self.train_state
        state.micro_steps += 1
        state.window_micro_steps = 0 if boundary else state.window_micro_steps + 1
        state.global_samples += self.train_micro_batch_size_per_gpu() * self.mesh.size("dp")
        if boundary:
            self._reporter.after_step(self)
            self._checkpoints.save_if_due()

    def _optimizer_update(self, grad_scale: torch.Tensor | float = 1.0) -> None:
        """Update once (the same branch on every rank: the norm is the same number everywhere); a skipped
        step still counts (DeepSpeed's behaviour on an fp16 overflow). `grad_scale`: the token-weighted
        loss's division by the global count (`engine/token_loss.py`)."""
        with self._phases.timed("comm_wait"):
            self.grad_sync.finish_gradients()
            if self.replica_groups is not None:  # the other groups' gradients (engine/replicas.py)
                self.replica_groups.sum_gradients(self.grad_sync.local_gradients())
        if self._window.token_weighted:  # the one count exchange of the step (engine/token_loss.py)
            extra = self.objective.take_metrics() if self.objective is not None else None
            self._window_loss, grad_scale, self._objective_metrics = self._window.finish(extra, self.replica_groups)
            self._reporter.record_loss(self._window_loss)
        elif self.replica_groups is not None:
            raise RunError("replica groups sum the step's token counts, but this step's losses were averaged "
                           "(loss.reduction \"micro_batch\", or a loss paratrain cannot weight): feed token "
                           "micro-batches with loss.reduction \"token\"")
        self._window.reset()
        if self.replica_groups is not None and not self.replica_groups.commit():
            self._discard_window()
            raise StepDiscarded(f"step {self.train_state.global_steps + 1} was not committed by the replica groups")
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

    def _discard_window(self) -> None:
        """A step the replica groups did not commit: its gradients zeroed and its micro-batches uncounted, as if
        the window had not started (the boundary micro-batch is counted after the update, so not yet)."""
        self.grad_sync.zero_grad()
        state = self.train_state
        state.micro_steps -= state.window_micro_steps
        state.global_samples -= state.window_micro_steps * self.train_micro_batch_size_per_gpu() * self.mesh.size("dp")
        state.window_micro_steps = 0

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one global batch (every micro-batch of this rank), step, and return the global mean loss."""
        with self._phases.together():
            if data_iter is None:
                if self.training_dataloader is None:
                    raise InvalidValueError("train_batch() needs data_iter= or training_data= passed to "
                                            "initialize()")
                data_iter = self.training_dataloader
            if self.pipeline is not None:
                return self._train_pipeline(data_iter)
            return self._train_micro_batches(data_iter)

    def _train_micro_batches(self, data_iter) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # no host sync per micro-batch
        self._window_loss = None
        for _ in range(self.gradient_accumulation_steps()):
            loss = self._forward.run(next(data_iter))
            self.backward(loss)
            self.step()
            if self._window_loss is None and split_loss(loss) is None:  # (a (sum, count): the window's)
                total += loss.detach().float()
        if self._window_loss is not None:  # token-weighted: the step's all-reduce already gave the global mean
            return self._window_loss
        return mean_over_ranks(total / self.gradient_accumulation_steps(), self.mesh.axis("dp_cp"))

    def _train_pipeline(self, data_iter) -> torch.Tensor:
        """A pipeline's whole step: every rank of a dp replica draws the same micro-batches; the first stage uses
        the inputs, the last the targets. The runner accumulates the step's gradients and shares the
        token-weighted loss over pp in its all-reduce; the update is the engine's as always."""
        count = self.gradient_accumulation_steps()
        batches = [self._forward.pipeline_batch(next(data_iter)) for _ in range(count)]
        self._forward.check_agreement(batches)
        if self.objective is not None:  # the reference log-probs the batches lack: a forward-only pass first
            self.objective.prepare_pipeline(batches)
        unit = self._window.set_unit(target_positions(batches[0]), count)
        with self._phases.timed("pipeline"):
            losses = self.pipeline.train_step(batches, unit)
        grad_scale = 1.0
        if losses.token_weighted:  # every pp rank holds the step's sums: one count exchange over dp x cp
            self._window.add(losses.total, losses.weight)
            mean, grad_scale, self._objective_metrics = self._window.finish(losses.extra)
        else:
            mean = mean_over_ranks(losses.mean.to(self.device), self.mesh.axis("dp_cp"))
        self._window.reset()
        self._reporter.record_loss(mean)
        with self._phases.timed("step"):
            self._optimizer_update(grad_scale)
        self.train_state.micro_steps += count
        self.train_state.global_samples += self.train_micro_batch_size_per_gpu() * self.mesh.size("dp") * count
        self._reporter.after_step(self)
        self._checkpoints.save_if_due()
        return mean

    # ---- evaluation and generation (engine/evaluation.py, engine/generation.py) ----------------------
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over `num_micro_batches` (default: gradient_accumulation_steps) without updating.
        DeepSpeed's PipelineEngine signature; only its defaults are supported (the loss, averaged)."""
        check_eval_arguments(return_logits, compute_loss, reduce_output, bcast_loss)
        return self._evaluator.eval_batch(data_iter, num_micro_batches)

    def evaluate(self, data, max_batches: int | None = None, collate_fn=None) -> torch.Tensor:
        """The loss over a whole dataset without updating: sum of every target token's loss / number of target
        tokens over all rows (one process's number, in every layout; engine/evaluation.py's note), or the
        objective's over its unit (pairs for dpo; its metrics then in `evaluation_metrics()`). `data`: rows (a
        map-style Dataset or a list: each rank takes its data-parallel share, micro_batch rows at a time, collated
        by `collate_fn` (default: the training loader's), the tail padded with masked rows) or an iterable of this
        rank's micro-batches (a DataLoader). `max_batches`: at most this many micro-batches per rank. The model
        returns to the mode it was in."""
        return self._evaluator.evaluate(data, max_batches, collate_fn)

    def evaluation_metrics(self) -> dict[str, float]:
        """The last evaluation's objective metrics over its whole data (TRL's names: rewards/accuracies, ...;
        the trainer logs them as eval/...); one host read. Empty for next-token loss."""
        return self._evaluator.metrics()

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 use_cache: bool = True) -> torch.Tensor:
        """The prompts followed by the generated tokens, (b, prompt + new), as transformers' `generate` returns
        them for a decoder-only model (left-padded prompts; a finished row continues with `pad_token_id`).
        Call it on every rank with the same arguments (a collective in tensor, expert and ZeRO-3 layouts)."""
        settings = GenerationSettings(max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                      pad_token_id, use_cache)
        return self._generator.generate(input_ids, attention_mask, settings, generator)

    @property
    def tokens_per_forward(self) -> int:
        """A forward's sequence length must be a multiple of this: tp under sequence parallelism, else 1."""
        return self._generator.tokens_per_forward

    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None, keys: torch.Tensor,
                max_new_tokens: int = 20, do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                pad_token_id: int | None = None, use_cache: bool = True) -> Rollout:
        """Completions of this rank's prompts (left-padded; each data-parallel replica its own, its tp, pp and cp
        peers the same), for training on them: each row sampled by its key (`paratrain.generation.rollout_keys`:
        seed, step, global prompt index, generation index), so every layout draws the same completions; with the
        log-probs the sampler used, which training recomputes (TRL's `old_per_token_logps`). Collective."""
        settings = GenerationSettings(max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                      pad_token_id, use_cache)
        return self._generator.rollout(prompt_ids, prompt_mask, keys, settings, self.global_steps + 1)

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
        self._checkpoints.close()  # an asynchronous save in flight uses a group the mesh is about to free
        self.monitor.close()
        if self.objective is not None:
            self.objective.destroy()
        self.mesh.destroy()
        self._phases.destroyed = True

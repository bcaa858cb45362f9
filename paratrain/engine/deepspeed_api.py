"""The rest of DeepSpeed's engine surface: accessors and small calls scripts touch, with DeepSpeed's meaning.

`Engine` inherits these accessors; they only read the state the engine owns (the attributes declared at the
top of the class) and change nothing but through the engine's methods. Anything DeepSpeed's engine has and
this one does not raises `DeepSpeedNotSupported` with the replacement (`compat/names.py`), never a silent
stand-in.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.adapters.quantized import encoded_values
from paratrain.checkpoint.pieces import gather_full_state
from paratrain.comm import all_gather_object
from paratrain.compat.names import DOCS, ENGINE, DeepSpeedNotSupported, refuse
from paratrain.config import Config
from paratrain.distributed import local_rank
from paratrain.engine.train_state import TrainState
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Mesh
from paratrain.precision import LossScaler


class DeepSpeedEngineAPI:
    # What the accessors read; `Engine` owns and sets all of it.
    config: Config
    mesh: Mesh
    module: nn.Module
    optimizer: torch.optim.Optimizer
    pipeline: object | None
    train_state: TrainState
    loss_scaler: LossScaler | None
    grad_sync: object
    parallel: object
    monitor: object  # paratrain.engine.monitor.Monitor
    device: torch.device
    _grad_norm: torch.Tensor | None
    _step_applied: bool
    _phases: object  # paratrain.engine.phases.Phases
    _reporter: object  # paratrain.engine.monitor.StepReporter
    objective: object | None  # paratrain.engine.objective_step.ObjectiveStep

    @property
    def device_mesh(self):
        """The torch DeviceMesh with axes dp, pp, cp, tp (size-1 axes included) and the flattened ones the
        strategies use (`device_mesh["dp_cp"]`, ...)."""
        return self.mesh.device_mesh

    # ---- step counters (DeepSpeed's names) -------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.train_state.global_steps

    @property
    def micro_steps(self) -> int:
        return self.train_state.micro_steps

    @property
    def global_samples(self) -> int:
        return self.train_state.global_samples

    @property
    def skipped_steps(self) -> int:
        return self.train_state.skipped_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.train_state.window_micro_steps + 1 == self.gradient_accumulation_steps()

    # ---- ranks and sizes -------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.mesh.rank

    @property
    def local_rank(self) -> int:
        return local_rank()

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def dp_world_size(self) -> int:
        """Ranks that draw different samples (`ParallelDims.sample_parallel_size`: dp); DeepSpeed's meaning,
        which leaves out sequence-parallel ranks. The batch arithmetic counts these."""
        return self.mesh.dims.sample_parallel_size

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks whose gradients are averaged (`ParallelDims.gradient_average_size`: dp x cp); DeepSpeed's
        meaning, which includes sequence-parallel ranks."""
        return self.mesh.dims.gradient_average_size

    @property
    def data_parallel_group(self):
        """The torch process group of the ranks that draw different samples, dp (None on one rank)."""
        return self.mesh.axis("dp").group

    @property
    def seq_data_parallel_group(self):
        """The torch process group gradients are averaged over, dp x cp (None on one rank)."""
        return self.mesh.axis("dp_cp").group

    def get_data_parallel_rank(self) -> int:
        return self.mesh.local_rank("dp")

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.local_rank("tp")

    def get_model_parallel_rank(self) -> int:
        """Megatron's meaning (DeepSpeed asks its mpu): the tensor-parallel rank."""
        return self.mesh.local_rank("tp")

    # ---- configuration, as DeepSpeed's accessors report it ---------------------------------------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """Whether per-phase times are logged (DeepSpeed's meaning); the times are engine.timings()."""
        return self.config.wall_clock_breakdown

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.enabled and self.config.fp16.loss_scale == 0

    def optimizer_name(self) -> str:
        return self.config.optimizer.type if self.config.optimizer is not None else type(self.optimizer).__name__

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch through the number of accumulated micro-batches (DeepSpeed's rule)."""
        per_micro_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_micro_step:
            raise InvalidValueError(f"train batch size {train_batch_size} must be divisible by micro-batch "
                                    f"({self.train_micro_batch_size_per_gpu()}) x data parallelism "
                                    f"({self.dp_world_size})")
        if self.pipeline is not None:
            raise InvalidValueError("set_train_batch_size is not supported with pipeline.stages > 1: the schedule is "
                                    "built for gradient_accumulation_steps micro-batches; set the batch in the config")
        if self.train_state.window_micro_steps:
            raise InvalidValueError("set_train_batch_size inside a gradient accumulation window: call it after "
                                    "engine.step() has updated the model")
        self.set_accumulation(train_batch_size // per_micro_step)

    # ---- optimizer state -------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Per param group: Adam's betas, else SGD/RMSprop's momentum (DeepSpeed's get_mom)."""
        return [g["betas"] if "betas" in g else g.get("momentum", 0.0) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step (read from the device here,
        not by the step)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when no loss scaling is in use)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def was_step_applied(self) -> bool:
        """True when the last step() updated the model (False on non-boundary micro-steps and fp16 skips)."""
        return self._step_applied

    def zero_grad(self) -> None:
        """Gradients are already zero after every optimizer step: a no-op there, refused inside a window
        (dropping part of an accumulated, possibly in-flight reduction is not something a strategy can undo)."""
        if self.train_state.window_micro_steps:
            raise InvalidValueError("engine.zero_grad() inside a gradient accumulation window is not supported: the "
                                    "engine zeroes gradients after each optimizer step; to discard this window's "
                                    "gradients, finish it with engine.step()")

    # ---- the module ------------------------------------------------------------------------------
    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        """Names as DeepSpeed's engine gives them: the model is its submodule `module`."""
        return self.module.named_parameters(prefix=prefix + "module" if not prefix else f"{prefix}.module",
                                            recurse=recurse)

    def module_state_dict(self) -> dict:
        """The complete, unsharded state dict of the model (every rank), as DeepSpeed's module_state_dict."""
        return self.full_state_dict()

    # ---- introspection (paratrain's own) ---------------------------------------------------------------------------
    def comm_stats(self, reset: bool = False, by_tag: bool = False) -> dict:
        """Collectives since the last reset: {axis: {op: {calls, elements, bytes}}}."""
        out = self.mesh.stats.snapshot(by_tag=by_tag)
        if reset:
            self.mesh.stats.reset()
        return out

    def parameter_counts(self) -> dict[str, int]:
        """Elements of the whole model, trainable (adapters, under LoRA) and frozen, over every rank (collective); a
        4-bit weight (QLoRA) counts the values it encodes, two per packed byte."""
        mine = {}
        for n, p in self.module.named_parameters():
            origin = self.parallel.origin(n, p)
            values = encoded_values(p) or math.prod(origin.shape)
            mine[origin.name] = (p.requires_grad, values)
        everyone = {k: v for part in all_gather_object(mine, self.mesh.world, tag="introspection")
                    for k, v in part.items()}
        return {"trainable": sum(n for grad, n in everyone.values() if grad),
                "frozen": sum(n for grad, n in everyone.values() if not grad)}

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model state this rank holds: params, grads, optimizer_state, total. With an objective's
        frozen reference model (`objective.reference` "initial") its weights are counted in params and total,
        and alone in reference_params (0 with the adapters off: no second copy)."""
        stats = self.grad_sync.memory_stats()
        if self.objective is None or self.objective.mode == "none":
            return stats
        reference = self.objective.reference
        extra = reference.grad_sync.memory_stats()["params"] if reference is not None else 0
        return {**stats, "params": stats["params"] + extra, "total": stats["total"] + extra,
                "device": stats["device"] + extra, "reference_params": extra}

    def moe_routing(self):
        """The MoE routing of the last step that reduced it (`paratrain.moe.RoutingStep`: per layer, tokens per
        expert over all dp x cp ranks, dropped choices, mean losses); None for a model without `MoELayer`s.
        Steps reduce it when they report it (a monitor on, every steps_per_print step); once this has been
        called, every step does (one all-reduce and host copy per step: the hot path otherwise reads nothing)."""
        self._reporter.wants_routing = True
        return self._reporter.routing

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send named values, e.g. {"eval/loss": 3.1}, to every enabled monitor and tracker (TensorBoard, CSV,
        W&B, MLflow) at optimizer step `step` (default: the current global_steps). Call it on every rank;
        rank 0 writes. Trackers then hold evaluation beside the training curves (docs/evaluation.md)."""
        self.monitor.log_metrics(metrics, self.global_steps if step is None else step)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The complete, unsharded state dict under the original names, on every rank (collective)."""
        return gather_full_state(self.parallel, self.mesh, self.device)

    def timings(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent so far in forward, backward, step (with comm_wait, the wait for gradient reductions,
        inside it) and, with a pipeline, the pipeline's part of the step."""
        out = dict(self._phases.times)
        if reset:
            self._phases.times.clear()
        return out

    def pipeline_timeline(self) -> dict | None:
        """The last step's executed actions with start/end times on every rank (collective over the world;
        None without a pipeline). `paratrain report` renders it."""
        return None if self.pipeline is None else self.pipeline.gather_timeline()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        refuse(ENGINE, "engine", name)


def check_eval_arguments(return_logits: bool, compute_loss: bool, reduce_output: str, bcast_loss: bool) -> None:
    """eval_batch takes DeepSpeed's PipelineEngine arguments; anything but their defaults is refused by name."""
    given = {"return_logits": (return_logits, False), "compute_loss": (compute_loss, True),
             "reduce_output": (reduce_output, "avg"), "bcast_loss": (bcast_loss, True)}
    for name, (value, default) in given.items():
        if value != default:
            raise DeepSpeedNotSupported(f"engine.eval_batch({name}={value!r}) is DeepSpeed API that paratrain does "
                                        f"not support: eval_batch returns the mean loss over the data-parallel "
                                        f"ranks; run engine.module yourself for outputs (see {DOCS})")

"""The rest of DeepSpeed's engine surface: accessors and small calls scripts touch, with DeepSpeed's meaning.

`Engine` inherits this mixin; it relies on the engine's `config`, `pmesh`, `module`, `optimizer`,
`grad_sync`, `pipeline`, `micro_steps`, `loss_scaler` and `_grad_norm`. Anything DeepSpeed's engine has and
this one does not raises `DeepSpeedNotSupported` with the replacement (`compat/names.py`), never a silent
stand-in.
"""

from __future__ import annotations

from paratrain.compat.names import DOCS, ENGINE, DeepSpeedNotSupported, refuse
from paratrain.distributed import local_rank


class DeepSpeedEngineAPI:
    # ---- ranks and sizes -------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.pmesh.rank

    @property
    def local_rank(self) -> int:
        return local_rank()

    @property
    def world_size(self) -> int:
        return self.pmesh.world_size

    @property
    def dp_world_size(self) -> int:
        """Ranks that draw different samples (`ParallelDims.sample_parallel_size`: dp); DeepSpeed's meaning,
        which leaves out sequence-parallel ranks. The batch arithmetic counts these."""
        return self.pmesh.dims.sample_parallel_size

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks whose gradients are averaged (`ParallelDims.gradient_average_size`: dp x cp); DeepSpeed's
        meaning, which includes sequence-parallel ranks."""
        return self.pmesh.dims.gradient_average_size

    @property
    def data_parallel_group(self):
        """The torch process group of the ranks that draw different samples, dp (None on one rank)."""
        return self.pmesh.axis("dp").group

    @property
    def seq_data_parallel_group(self):
        """The torch process group gradients are averaged over, dp x cp (None on one rank)."""
        return self.pmesh.axis(("dp", "cp")).group

    def get_data_parallel_rank(self) -> int:
        return self.pmesh.local_rank("dp")

    def get_tensor_parallel_rank(self) -> int:
        return self.pmesh.local_rank("tp")

    def get_model_parallel_rank(self) -> int:
        """Megatron's meaning (DeepSpeed asks its mpu): the tensor-parallel rank."""
        return self.pmesh.local_rank("tp")

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
            raise ValueError(f"train batch size {train_batch_size} must be divisible by micro-batch "
                             f"({self.train_micro_batch_size_per_gpu()}) x data parallelism ({self.dp_world_size})")
        if self.pipeline is not None:
            raise ValueError("set_train_batch_size is not supported with pipeline.stages > 1: the schedule is "
                             "built for gradient_accumulation_steps micro-batches; set the batch in the config")
        if self._micro_steps_in_window():
            raise ValueError("set_train_batch_size inside a gradient accumulation window: call it after "
                             "engine.step() has updated the model")
        self.config.train_batch_size = train_batch_size
        self.config.gradient_accumulation_steps = train_batch_size // per_micro_step

    # ---- optimizer state -------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Per param group: Adam's betas, else SGD/RMSprop's momentum (DeepSpeed's get_mom)."""
        return [g["betas"] if "betas" in g else g.get("momentum", 0.0) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        return self._grad_norm

    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when no loss scaling is in use)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def was_step_applied(self) -> bool:
        """True when the last step() updated the model (False on non-boundary micro-steps and fp16 skips)."""
        return self._step_applied

    def zero_grad(self) -> None:
        """Gradients are already zero after every optimizer step: a no-op there, refused inside a window
        (dropping part of an accumulated, possibly in-flight reduction is not something a strategy can undo)."""
        if self._micro_steps_in_window():
            raise ValueError("engine.zero_grad() inside a gradient accumulation window is not supported: the "
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

    # ---- helpers ---------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Free the engine's process groups (DeepSpeed's engine.destroy releases its resources likewise).
        Collective: call on every rank once it has finished with this engine; afterwards it cannot train."""
        self.pmesh.destroy()
        self.destroyed = True

    def _micro_steps_in_window(self) -> int:
        """Micro-steps since the last optimizer step (0 at a boundary): not micro_steps % accumulation, which
        set_train_batch_size would break."""
        return self._window_micro_steps

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

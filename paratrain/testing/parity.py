"""A layout against the single-process reference: the loop of every parity test and of `paratrain verify`.

    run = run_layout(config, make_model, dataset, steps)            # on every rank of a launched world
    ref = reference_run(make_model, reference_config(config, run), dataset, steps)   # one process
    rows = compare(run, ref)                                         # one StepComparison per step

Both sides see the same global batches (the data-parallel sampler's order), so every difference is the
parallel code's. `run_layout` never raises for a wrong result: a state that cannot even be assembled (tensors
replicated over tp that differ between ranks, say) is recorded as that step's error, and the run goes on, so
every rank keeps issuing the same collectives.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.testing.compare import max_rel_diff, rel_diff
from paratrain.testing.reference import RunRecord, reference_run

# fp32 must match to rounding; bf16/fp16 runs are compared with a same-dtype reference, which they match only
# to that dtype's rounding amplified by Adam (see tests/distributed/test_zero_parity.py's note on mixed precision).
TOLERANCE = {"fp32": 1e-5, "bf16": 2.5e-2, "fp16": 2e-2}


@dataclass
class StepRecord:
    loss: float
    grad_norm: float | None
    state: dict[str, torch.Tensor] | None = None  # the full (unsharded) state after the step, where kept
    error: str | None = None


@dataclass
class LayoutRun:
    case: str  # the layout in words, e.g. "dp2 x pp2 x tp2 zero1 1f1b sp ckpt:full"
    train_batch_size: int
    steps: list[StepRecord]
    extra: dict = field(default_factory=dict)  # what `inspect(engine)` returned

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def grad_norms(self) -> list[float | None]:
        return [s.grad_norm for s in self.steps]

    @property
    def final_state(self) -> dict[str, torch.Tensor] | None:
        return self.steps[-1].state if self.steps else None


def describe_layout(config) -> str:
    """The parts of a resolved Config that make a layout, in words."""
    parts = []
    zero = config.zero_optimization
    if zero.stage:
        parts.append(f"zero{zero.stage}")
    if config.pipeline.stages > 1:
        parts.append(config.pipeline.schedule)
    if config.tensor_parallel.size > 1 and config.tensor_parallel.sequence_parallel:
        parts.append("sp")
    if config.activation_checkpointing.enabled:
        parts.append(f"ckpt:{config.activation_checkpointing.granularity}")
    if config.precision != "fp32":
        parts.append(config.precision)
    return " ".join(parts)


def run_layout(config: dict, make_model: Callable[[], nn.Module], dataset, steps: int, *,
               state_every_step: bool = False, keep_state: bool = True,
               inspect: Callable | None = None, model_parameters: Callable | None = None,
               collate_fn=None, objective=None) -> LayoutRun:
    """Train `steps` optimizer steps of `make_model()` in the layout of `config` (collective: call on every
    rank). The full state is gathered after the last step, or after every step with `state_every_step`
    (collective too); `keep_state=False` drops it after gathering (ranks whose copy is not needed)."""
    from paratrain.api import initialize

    model = make_model()
    engine, *_ = initialize(model=model, config=copy.deepcopy(config), training_data=dataset, collate_fn=collate_fn,
                            model_parameters=model_parameters(model) if model_parameters else None,
                            objective=objective)
    cfg = engine.config
    layout = describe_layout(cfg)
    case = engine.mesh.dims.describe() + (f" {layout}" if layout else "")
    records = []
    for step in range(steps):
        loss = float(engine.train_batch())
        record = StepRecord(loss, engine.get_global_grad_norm())
        if state_every_step or step == steps - 1:
            try:
                state = engine.full_state_dict()
                record.state = state if keep_state else None
            except Exception as exc:  # noqa: BLE001 - recorded and reported as this step's failure
                record.error = f"{type(exc).__name__}: {exc}"
        records.append(record)
    extra = inspect(engine) if inspect is not None else {}
    return LayoutRun(case, engine.train_batch_size(), records, extra)


def reference_config(config: dict, run: LayoutRun) -> dict:
    """`config` with the global batch the layout trained on (the reference is one process: no layout keys
    matter to it)."""
    return {**copy.deepcopy(config), "train_batch_size": run.train_batch_size}


@dataclass
class StepComparison:
    step: int
    loss: float
    ref_loss: float
    loss_err: float
    grad_norm: float | None
    ref_grad_norm: float
    norm_err: float
    param_err: float | None  # None when the layout kept no state at this step
    where: str
    error: str | None
    tolerance: float

    @property
    def passed(self) -> bool:
        checks = [self.loss_err, self.norm_err] + ([self.param_err] if self.param_err is not None else [])
        return self.error is None and all(math.isfinite(e) and e <= self.tolerance for e in checks)


def compare(run: LayoutRun, ref: RunRecord, tolerance: float = TOLERANCE["fp32"]) -> list[StepComparison]:
    """Per step: the relative error of the loss, of the global grad norm and of the parameters (where the
    layout kept its state; the reference needs `keep_states=True` for steps before the last)."""
    rows = []
    for i, (mine, loss, norm) in enumerate(zip(run.steps, ref.losses, ref.grad_norms)):
        want = ref.states[i] if ref.states else (ref.state if i == len(run.steps) - 1 else None)
        param_err, where = (None, "")
        error = mine.error
        if mine.state is not None and want is not None:
            try:
                param_err, where = max_rel_diff(mine.state, want)
            except KeyError as exc:
                error = str(exc)
        norm_err = rel_diff(mine.grad_norm, norm) if mine.grad_norm is not None else math.inf
        rows.append(StepComparison(i + 1, mine.loss, loss, rel_diff(mine.loss, loss), mine.grad_norm, norm,
                                   norm_err, param_err, where, error, tolerance))
    return rows


def summarize(rows: list[StepComparison]) -> dict:
    """The worst errors over the steps (what a test asserts on)."""
    params = [r.param_err for r in rows if r.param_err is not None]
    worst = max(rows, key=lambda r: r.param_err if r.param_err is not None else -1.0)
    return {"loss_err": max(r.loss_err for r in rows), "norm_err": max(r.norm_err for r in rows),
            "param_err": max(params) if params else math.inf, "where": worst.where,
            "errors": [r.error for r in rows if r.error], "passed": all(r.passed for r in rows)}


def layout_parity(config: dict, make_model: Callable[[], nn.Module], dataset, steps: int, *,
                  inspect: Callable | None = None, model_parameters: Callable | None = None,
                  references: dict | None = None) -> dict:
    """Run the layout and (in this process) the reference; the summary plus the case, losses and grad
    norms. `references` caches reference runs by their config within one process."""
    run = run_layout(config, make_model, dataset, steps, inspect=inspect, model_parameters=model_parameters)
    ref_cfg = reference_config(config, run)
    key = (id(make_model), id(dataset), id(model_parameters),
           repr(sorted((k, repr(v)) for k, v in ref_cfg.items() if k in REFERENCE_KEYS)))
    if references is None or key not in references:
        ref = reference_run(make_model, ref_cfg, dataset, steps, param_groups=model_parameters)
        if references is not None:
            references[key] = ref
    else:
        ref = references[key]
    return {"case": run.case, **summarize(compare(run, ref)), "losses": run.losses, "grad_norms": run.grad_norms,
            **run.extra}


# The config keys a reference run depends on (everything else is layout).
REFERENCE_KEYS = ("train_batch_size", "optimizer", "scheduler", "gradient_clipping", "seed", "fp16", "bf16",
                  "torch_autocast")

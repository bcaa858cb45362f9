"""The contract between the engine and a data-parallel strategy (DDP, ZeRO-1/2, ZeRO-3).

The engine never looks inside a strategy: it tells it when a backward is about to run (and whether it
ends a gradient-accumulation window), asks it to finish gradient reduction, for its gradients (the engine
computes the global norm from them, `paratrain.grad_norm`), to scale gradients (clipping), to step, and to
zero gradients. Each strategy owns where gradients and optimizer states live, which is the whole difference
between DDP and the ZeRO stages. A strategy is given one axis, the one it averages gradients over, and
knows nothing of the model-parallel axes: what they did is recorded on the parameters (`paratrain.layout.placement`).
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.adapters.quantized import plain_tensors, quantization_state
from paratrain.errors import Error, RunError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Partition, Placement, Placements
from paratrain.muon import MasterLayout, whole_parameter_layout

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


class UnusedParametersError(Error, RuntimeError):
    """Parameters that took part in no backward of a step (every data-parallel strategy raises this one)."""

    @classmethod
    def naming(cls, missing: list[str]) -> UnusedParametersError:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        return cls(f"{len(missing)} parameter(s) received no gradient in this step: {shown}. Either use them in "
                   f"the forward pass, freeze them (requires_grad=False), or set data_parallel."
                   f"allow_unused_parameters to true")


def is_expert(param: torch.Tensor, placements: Placements) -> bool:
    """Split over the ep axis (an MoE layer's stacked experts): reduced over the expert-data-parallel axis."""
    return placements.of(param).get("ep") is not None




def weak_hook(method):
    """`method` (bound) as a tensor hook that does not keep its object alive.

    [Note: why weak] A parameter's hooks live in a dict the garbage collector cannot see through, so a
    bound method there makes the cycle parameter -> hook -> strategy -> parameter unbreakable: every engine
    built in a process would live on with its buffers and process groups (whose threads keep waking). With
    a weak reference the strategy dies with its engine; a hook that outlives it does nothing.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def on_device_of(factor: torch.Tensor | float, tensors: list[torch.Tensor]) -> torch.Tensor | float:
    """`factor` where `tensors` live: a 0-dim device tensor cannot multiply host tensors (offloaded masters),
    so those get a host copy (the host optimizer needs its value anyway); a float stays a float."""
    if not isinstance(factor, torch.Tensor) or not tensors or tensors[0].device == factor.device:
        return factor
    return factor.to(tensors[0].device)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer are counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # Scalar step counters are bookkeeping, not model state; the formulas count the moments only.
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def placement_spans(tensors: list[tuple[int, int, Placement]]) -> list[tuple[int, int, Placement]]:
    """Merge consecutive (start, end, placement) ranges of one flat buffer that share a placement, so the
    gradient norm reads the buffer in as few pieces as possible (one, when its parameters share one placement)."""
    out: list[tuple[int, int, Placement]] = []
    for start, end, placement in tensors:
        if out and out[-1][2] == placement and out[-1][1] == start:
            out[-1] = (out[-1][0], end, placement)
        else:
            out.append((start, end, placement))
    return out


@dataclass(frozen=True)
class MasterSegment:
    """Part of a local parameter held in one of the optimizer's tensors (a master): elements [start, end) of
    the flattened parameter are elements [offset, offset + end - start) of the flattened master."""

    name: str  # the parameter's name in the local module
    start: int
    end: int
    offset: int


class GradSync(ABC):
    """A data-parallel strategy: owns gradient reduction, optimizer placement and the update."""

    def __init__(self, module: nn.Module, axis: Axis, expert_axis: Axis | None = None,
                 placements: Placements | None = None, replicate: Axis | None = None):
        self.module = module
        # How the earlier steps laid each parameter out (the parallel model's records; none: all replicated):
        # what an expert is, and how the gradient norm weighs each gradient.
        self.placements = Placements() if placements is None else placements
        # Gradients are averaged over this axis: every rank of it saw different data (the engine passes dp x
        # cp: context-parallel ranks saw other tokens of the same samples). The strategy knows no other axis.
        self.axis = axis
        # Parameters split over ep (experts) are summed over this one instead (edp: the ranks holding the same
        # experts), and still divided by the ranks that saw different tokens (`paratrain.parallel.ep.split`).
        self.expert_axis = expert_axis
        # HSDP: the ranks of `axis` shard, and groups of them replicate over this axis (dp_replicate): each
        # replica holds the same shards, so its gradients are summed over it once a step (`sum_over_replicas`).
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        # Replica groups (fault tolerance): called with (its index in `local_gradients()`, the tensor) for a gradient
        # shard that is final while the window's last backward still runs, so the groups' sum of it starts early.
        # A strategy that has no such point leaves every shard to `local_gradients()` after finish_gradients.
        self.final_gradient_hook: Callable[[int, torch.Tensor], None] | None = None
        self.early_replica_sums = 0  # of the last step's shards, how many began that sum during the backward (ZeRO-3)
        self.optimizer: torch.optim.Optimizer | None = None
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    @property
    def average_size(self) -> int:
        """Ranks whose gradients are averaged (they saw different tokens): dp x cp, replicas included."""
        return self.axis.size * (self.replicate.size if self.replicate is not None else 1)

    @contextmanager
    def gathered_for_inference(self):
        """Parameters whole for a run of forwards without gradients (generation): nothing to do unless
        parameters are sharded (ZeRO-3 gathers every unit once and keeps it for the duration)."""
        yield

    @property
    def gradient_divisor(self) -> float:
        """What the reduced gradients are still to be divided by: the ranks averaged over, less the pre-divide
        (`gradient_predivide_factor`). The strategy does not divide: the update folds it into the one pass that
        also applies the token count, the loss scale and the clip factor (`engine/update.py`)."""
        return self.post_divide

    def replicas(self, tensor: torch.Tensor, sharded: bool) -> tuple[Axis, ...]:
        """The data-parallel axes whose ranks hold the same values of `tensor` as this rank: the axis it is
        reduced over, unless this rank holds a shard of it there (`sharded`), and the replicate axis (HSDP)."""
        out = () if sharded else (self.axis_of(tensor),)
        return out + ((self.replicate,) if self.replicate is not None else ())

    def sum_over_replicas(self, grads: list[torch.Tensor], device: torch.device) -> None:
        """HSDP: every gradient shard summed over the replicas (one all-reduce each, in flight together), once a
        step after the window's last reduce-scatter; a shard held elsewhere (offloaded) is reduced on `device`."""
        if self.replicate is None:
            return
        staged = [g if g.device == device else g.to(device) for g in grads]
        handles = [comm.all_reduce(g, self.replicate, tag="grad", async_op=True) for g in staged]
        for grad, on, handle in zip(grads, staged, handles):
            handle.wait()
            if on is not grad:
                grad.copy_(on)

    def axis_of(self, param: torch.Tensor) -> Axis:
        """The axis `param`'s gradient is reduced (and, under ZeRO, sharded) over."""
        return self.expert_axis if self.expert_axis is not None and is_expert(param, self.placements) else self.axis

    def broadcast_state(self, buffers: bool = True) -> None:
        """Make every rank's parameters (and buffers) equal to those of the first rank of the axis each is
        reduced over (`axis_of`: experts over the ranks holding the same experts): one flat broadcast per
        dtype and axis."""
        # a torchao NF4 weight is broadcast as the plain tensors it holds
        tensors = [t for p in self.module.parameters() for t in plain_tensors(p)] + \
            (list(self.module.buffers()) if buffers else [])
        groups: dict[tuple[str, bool], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((str(t.dtype), self.axis_of(t) is not self.axis), []).append(t)
        with torch.no_grad():
            for (_, expert), group in sorted(groups.items()):
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                comm.broadcast(flat, self.expert_axis if expert else self.axis, src=0, tag="init")
                if self.replicate is not None:  # then every replica from the first one's
                    comm.broadcast(flat, self.replicate, src=0, tag="init")
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    # ---- lifecycle -------------------------------------------------------------------------------
    @abstractmethod
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        """Create the optimizer over whatever this strategy updates (full params, or this rank's shard)."""

    @abstractmethod
    def prepare_backward(self, sync: bool) -> None:
        """Called before each backward; `sync` is True when it ends a gradient-accumulation window."""

    @abstractmethod
    def finish_gradients(self) -> None:
        """After the last backward of a window: complete every reduction; gradients are then averaged."""

    def local_gradients(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds after finish_gradients (its ZeRO shards), to be summed in place with
        the same rank of other replica groups (fault tolerance: `engine.join_replica_groups`)."""
        raise RunError(f"{type(self).__name__} does not expose its gradient shards for replica groups; use "
                       f"zero_optimization.stage 1, 2 or 3")

    @abstractmethod
    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]:
        """Every gradient element this rank holds once, in pieces with the placement of their parameters
        (for the global norm, `paratrain.grad_norm`); valid between finish_gradients and zero_grad."""

    @property
    @abstractmethod
    def shards_gradients(self) -> bool:
        """True when the ranks of `self.axis` hold disjoint slices of the averaged gradient (ZeRO)."""

    def held_placement(self, param: torch.Tensor) -> Placement:
        """`param`'s placement with the data-parallel dim its gradient is held over: a sharding strategy's ranks
        of `axis_of(param)` hold disjoint slices (Partition); a replicating one's hold copies (no record)."""
        placement = self.placements.of(param)
        return placement.with_axis(self.axis_of(param).name, Partition()) if self.shards_gradients else placement

    @abstractmethod
    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient this rank holds by `factor` (clipping, loss-scale removal, the token count's
        division): a host float, or a 0-dim device tensor the step never reads."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Apply the update to the model's parameters (and re-assemble them if they are sharded)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Start a new accumulation window."""

    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds: params, grads, optimizer_state, total, and how much of it is on the host
        (offloaded) vs the device."""

    # ---- checkpoint hooks (paratrain/checkpoint reads and writes through these only) --------------
    @abstractmethod
    def master_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        """Every tensor the optimizer updates (its key in `optimizer.state`) with the parameter ranges it
        holds. Masters are fp32 (or the model's dtype where the model is its own master); a range of a
        master and the same range of each of its tensor optimizer states belong to the same parameter."""

    def frozen_segments(self) -> list[tuple[torch.Tensor, list[MasterSegment]]]:
        """The frozen parameters the strategy keeps in shards of its own (`named_frozen`), as `master_segments`
        describes masters: each shard with the parameter ranges this rank holds; no optimizer state."""
        return []

    @property
    def named_frozen(self) -> list[tuple[str, nn.Parameter]]:
        """The frozen parameters the strategy shards itself (ZeRO-3: all of them); default none, each frozen
        parameter then being an ordinary tensor of the module, whole on this rank."""
        return []

    @property
    @abstractmethod
    def masters_replicated(self) -> bool:
        """True when every rank of `self.axis` holds the same masters (DDP, unsharded stage 0)."""

    @abstractmethod
    def masters_loaded(self) -> None:
        """The masters were overwritten (a checkpoint was loaded): make the model's parameters equal to
        them (collective over `self.axis` where parameters are gathered) and start a new window."""

    # ---- shared behaviour ------------------------------------------------------------------------
    def frozen_param_bytes(self) -> int:
        """Bytes of the frozen parameters this rank holds whole, as ordinary tensors of the module (every strategy
        but ZeRO-3, which shards them), with a 4-bit weight's quantization state: counted in memory_stats' params."""
        trainable = {id(p) for _, p in self.named_params}
        frozen = [p for p in self.module.parameters() if id(p) not in trainable]
        # a 4-bit base (QLoRA) also holds its blocks' scales beside the packed data (adapters/quantized.py)
        states = {id(t): t for p in frozen for t in quantization_state(p)}
        return tensor_bytes(t for p in frozen for t in plain_tensors(p)) + tensor_bytes(states.values())

    def muon_layouts(self) -> list[tuple[torch.Tensor, MasterLayout]]:
        """What each optimizer tensor holds, for Muon's whole-matrix step (`paratrain.muon.layout`). Here: whole
        local parameters (each master is one); a strategy updating shards of flat buffers says so instead."""
        params = dict(self.named_params)
        out = []
        for master, (segment, *_) in self.master_segments():
            param = params[segment.name]
            out.append((master, whole_parameter_layout(param, self.placements.of(param))))
        return out

    def wait_for_params(self) -> None:  # noqa: B027 - only ZeRO-1/2 defer a write to the parameters
        """Complete whatever still writes the model's parameters (ZeRO-1/2's all-gather after the update runs
        behind the next forward): afterwards every parameter holds its updated value. Reads through the
        modules wait by themselves; this is for a parameter tensor held from before the step."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters and buffers under their original names (a copy, on every rank)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

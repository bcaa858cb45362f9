"""ZeRO stage 3 / FSDP: parameters, gradients and optimizer states all sharded over the dp axis.

The model is changed in place (FSDP2-style: every module and parameter keeps its identity, no wrapper):
each unit's parameters become views of a flat buffer (`fsdp_units.FlatParam`) whose storage exists only
while the unit is in use. Per micro-step:

  root pre-forward   gather the root unit (and the persistent one, if stale); prefetch the first unit
  unit pre-forward   wait for / start its all-gather, prefetch the next `prefetch_depth` units
  unit post-forward  free it (`reshard_after_forward`), hook its outputs for the backward
  unit pre-backward  gather it again, prefetch the unit before it in forward order
  unit post-backward (its inputs' gradients are computed: FSDP2's post-backward) its gradients go into the
                     staging buffer in one `cat` per flat buffer, are reduce-scattered, and it is freed
A unit whose inputs need no gradient (the root: token ids) is staged at autograd's end-of-backward callback. No
hook and no copy per parameter. Reductions are collected at the next backward or the step, overlapping what
follows; the update touches only the shards. `reduce_at_boundary` keeps gradients staged through a window.
Under HSDP (`replicate`), each shard the window's last backward collects is final, and its all-reduce over the
replicas is launched then, beside the rest of the backward, rather than after it.

[Note: the root is not freed after forward]
The root's backward starts as soon as its forward ends (the loss), so freeing it would only regather it
at once; FSDP2 keeps the root gathered for the same reason. Per optimizer step the root unit therefore
moves one all-gather, every other unit two: all-gather elements = 2 Ψ_units + Ψ_root (exactly 2Ψ when the
root owns no parameters), reduce-scatter = Ψ, both padded to a multiple of N per flat buffer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

import paratrain.comm as comm
from paratrain.data.nested import tensors_in
from paratrain.errors import RunError
from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Placement, Placements
from paratrain.parallel.dp.base import (
    GradSync,
    OptimizerFactory,
    UnusedParametersError,
    on_device_of,
    weak_hook,
)
from paratrain.parallel.dp.flat import OffloadPolicy, cast_untracked, optimizer_groups
from paratrain.parallel.dp.frozen import FrozenShard
from paratrain.parallel.dp.fsdp_state import ShardedState
from paratrain.parallel.dp.fsdp_units import (
    FlatParam,
    Unit,
    WrapPolicy,
    build_units,
    config_wrap_policy,
    in_backward,
)
from paratrain.precision import compute_dtype


class FullyShardedDataParallel(ShardedState, GradSync):
    def __init__(self, module: nn.Module, axis: Axis, precision: str = "fp32", offload: OffloadPolicy | None = None,
                 wrap_policy: WrapPolicy | None = None, reshard_after_forward: bool = True,
                 persistence_threshold: int = 100_000, prefetch_depth: int = 1,
                 allow_unused_parameters: bool = False, predivide_factor: float = 1.0,
                 reduce_at_boundary: bool = False, sync_initial_state: bool = True, expert_axis: Axis | None = None,
                 placements: Placements | None = None, replicate: Axis | None = None):
        super().__init__(module, axis, expert_axis, placements, replicate)
        self.reduce_at_boundary = reduce_at_boundary
        self.pre_divide = predivide_factor
        self.post_divide = self.average_size / predivide_factor
        self.dtype = compute_dtype(precision)
        self.offload = offload or OffloadPolicy(torch.device("cpu"))
        self.wrap_policy = wrap_policy or config_wrap_policy(module, None, None)
        self.reshard_after_forward = reshard_after_forward
        self.persistence_threshold = persistence_threshold
        self.prefetch_depth = prefetch_depth
        self.allow_unused = allow_unused_parameters
        if sync_initial_state:  # False: meta parameters, filled shard by shard later (deferred init)
            self.broadcast_state()
        self.root: Unit | None = None
        self.units: list[Unit] = []  # non-root units, in module order
        self.persistent: Unit | None = None
        self._order: list[Unit] = []  # units in the order the last forward ran them
        self._place: dict[Unit, int] = {}  # each unit's index in _order
        self._recording: list[Unit] = []
        self._launched: list[Unit] = []  # units whose reduce-scatter is in flight, in launch order
        self._backward_pending = False
        self._reducing = True  # the running backward reduce-scatters (False: reduce_at_boundary, mid-window)
        self._first_in_window = True
        self._end_queued = False  # the end-of-backward callback is queued for the running backward
        self._missing: list[str] = []  # parameters the running window's last backward gave no gradient
        self._boundary = True  # the running backward ends the window: the shards it collects are final
        self._replica_sums: dict[int, comm.Handle] = {}  # HSDP: id(flat) -> its sum over the replicas, in flight
        self.early_replica_sums = 0  # HSDP: of the last step's shards, how many were launched during the backward
        self._hooked = 0  # replica groups: the shards of the running window handed to `final_gradient_hook`
        self._flat_index: dict[int, int] | None = None

    # ---- sharding (needs the param groups, so it happens with the optimizer) ---------------------
    def build_optimizer(self, factory: OptimizerFactory, param_groups: list | None = None) -> torch.optim.Optimizer:
        self.root, self.units, self.persistent, groups = build_units(
            self.module, self.wrap_policy, self.persistence_threshold, param_groups, self.axis_of, self.dtype,
            self.offload, self.reshard_after_forward)
        self._set_order(list(self.units))
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, a, k, u=unit: self._pre_forward(u, a, k), with_kwargs=True)
            unit.module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
        self.module.register_forward_pre_hook(lambda m, a: self._root_pre_forward())
        self.module.register_forward_hook(lambda m, a, out: self._root_post_forward(out))
        tracked = {slot.param for f in [*self._flats(), *self._frozen()] for slot in f.layout.slots}
        cast_untracked(self.module, self.dtype, tracked)
        self.optimizer = factory(optimizer_groups(groups))
        return self.optimizer

    def _all_units(self) -> list[Unit]:
        return [u for u in [self.root, *self.units, self.persistent] if u is not None]

    # ---- forward ----------------------------------------------------------------------------------
    def _prefetch(self, units: list[Unit]) -> None:
        for unit in units[:self.prefetch_depth]:
            unit.gather()

    def _set_order(self, order: list[Unit]) -> None:
        """The units in the order the forward runs them, and each unit's place in it (a dict: finding a unit's
        neighbours is O(1) per hook, not a scan of the order)."""
        self._order = order
        self._place = {unit: i for i, unit in enumerate(order)}

    def _root_pre_forward(self) -> None:
        self._recording = []
        for unit in (self.persistent, self.root):
            if unit is not None:
                unit.wait()
        self._prefetch(self._order)

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict):
        if in_backward():  # activation recomputation: gather, but it is not a step of the forward order
            unit.wait()
            return None
        self._recording.append(unit)
        unit.wait()
        i = self._place.get(unit)
        if i is not None:
            self._prefetch(self._order[i + 1:i + 1 + self.prefetch_depth])
        if torch.is_grad_enabled():  # its backward is over once its inputs have their gradients
            return watch_inputs(unit, args, kwargs, weak_hook(self._inputs_ready))
        return None

    def _post_forward(self, unit: Unit, output) -> None:
        if in_backward():
            # [Note: recomputed forwards keep the unit] Activation checkpointing reruns this unit's forward
            # inside the backward of a region around it; the unit's own backward comes next and reads the
            # parameters the recompute saved, so it stays gathered until its gradients are reduced.
            return
        if not torch.is_grad_enabled():
            unit.reshard()
            return
        if unit.reshard_after_forward:
            unit.reshard()
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grad, u=unit: self._pre_backward(u), mode="any")

    def _root_post_forward(self, output) -> None:
        if self._recording:
            self._set_order(self._recording)
        if not torch.is_grad_enabled():
            for unit in self._all_units():
                unit.reshard()
            return
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:  # the backward's first node: ask for a call at its end
            register_multi_grad_hook(tensors, lambda grad: self._queue_end_of_backward(), mode="any")

    def _queue_end_of_backward(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Autograd's last call of a backward: stage (and launch) the units the post-backward hooks left."""
        self._end_queued = False
        self._missing += self._stage_leftovers(reshard=True)

    # ---- backward ---------------------------------------------------------------------------------
    def _pre_backward(self, unit: Unit) -> None:
        self._queue_end_of_backward()
        unit.wait()
        i = self._place.get(unit)
        if i is not None:
            self._prefetch(self._order[max(0, i - self.prefetch_depth):i][::-1])

    def _inputs_ready(self, unit: Unit) -> None:
        """The unit's post-backward: its inputs' gradients are computed, so (autograd runs a leaf's gradient
        accumulation as soon as it can) its parameters' gradients are normally all in `.grad`: stage them in
        one copy per flat buffer and launch the reduce-scatter. A gradient still missing (a weight also used
        outside the unit, an unused one) leaves the unit to the end of the backward (`_stage_leftovers`)."""
        unit.inputs_done = True
        if unit.flats and not unit.staged and all(f.grads_arrived() for f in unit.flats):
            self._stage(unit)
        if unit.backward_over:
            unit.reshard()

    def _stage(self, unit: Unit) -> list[str]:
        """Copy the unit's gradients in (missing ones: zero) and launch its reduction when this backward
        reduces; the names of the trainable parameters that got no gradient."""
        missing = [name for f in unit.flats for name in f.stage_grads(accumulate=self.reduce_at_boundary)]
        if self._reducing:
            self._launch_reduce(unit)
        unit.staged = unit.params_done = True
        return missing

    def _launch_reduce(self, unit: Unit) -> None:
        # [Note: one reduce-scatter in flight] The previous unit's reduction had this unit's whole backward
        # to finish; collecting it now frees its full-size gradient buffer, so at most two units' gradients
        # exist at once instead of the whole model's (FSDP2 bounds its reduce-scatter inputs the same way).
        self._collect_launched()
        unit.reduce_handles = [f.reduce(self._first_in_window, self.pre_divide) for f in unit.flats]
        unit.reduce_launched = True
        self._launched.append(unit)

    def _collect_launched(self) -> None:
        for unit in self._launched:
            for flat, handle in zip(unit.flats, unit.reduce_handles):
                handle.wait()
                flat.collect()
                self._launch_replica_sum(flat)
            unit.reduce_handles = []
        self._launched = []

    def _launch_replica_sum(self, flat: FlatParam) -> None:
        """In the window's last backward a collected shard is final, so its sum over the replicas starts now and
        runs beside the rest of the backward (`finish_gradients` waits for it): HSDP's all-reduce over dp_replicate,
        or else the replica groups' (`final_gradient_hook`). An offloaded shard is summed at the end, on the
        device."""
        if not self._boundary or (self.replicate is None and self.final_gradient_hook is None):
            return
        grad = flat.master.ensure_grad()
        if grad.device != self.offload.device:
            return
        if self.replicate is not None:
            self._replica_sums[id(flat)] = comm.all_reduce(grad, self.replicate, tag="grad", async_op=True)
            return
        if self._flat_index is None:
            self._flat_index = {id(f): i for i, f in enumerate(self._flats())}  # `local_gradients()`' order
        self._hooked += 1
        self.final_gradient_hook(self._flat_index[id(flat)], grad)

    def prepare_backward(self, sync: bool) -> None:
        if self._backward_pending:
            if self._reducing:
                self._collect()
            else:  # reduce_at_boundary: the gradients stay staged (unsharded) until the window's last backward
                self._stage_leftovers()
                self._missing = []
                for unit in self._all_units():
                    unit.staged = False
        self._reducing = sync or not self.reduce_at_boundary
        self._boundary = sync  # after collecting the previous backward, whose shards were not final
        self._backward_pending = True

    @contextmanager
    def no_sync(self):
        raise RunError("no_sync() needs full gradients to accumulate into, which ZeRO stage 3 does not keep; "
                       "use gradient_accumulation_steps instead")
        yield  # pragma: no cover

    def _stage_leftovers(self, reshard: bool = False) -> list[str]:
        """Stage (and, when reducing, launch) every unit the backward left: the root, units whose inputs need
        no gradient; the names of parameters without a gradient. `reshard` (at the end of the backward):
        free those whose backward is over, as their post-backward would have."""
        missing = []
        for unit in self._all_units():
            if unit.flats and not unit.staged:
                missing += self._stage(unit)
                if reshard and unit.backward_over:
                    unit.reshard()
        return missing

    def _collect(self) -> None:
        """Finish this backward: stage and reduce what the post-backward hooks left, wait, add into the shards."""
        missing, self._missing = self._missing + self._stage_leftovers(), []
        if missing and not self.allow_unused:
            raise UnusedParametersError.naming(missing)
        self._collect_launched()
        for unit in self._all_units():
            unit.reduce_launched = unit.staged = False
        self._first_in_window = False
        self._backward_pending = False

    def finish_gradients(self) -> None:
        self.early_replica_sums = len(self._replica_sums) + self._hooked  # launched while the backward ran
        if self._backward_pending:
            self._collect()  # also reduces what a window without a sync backward left staged
        self._hooked = 0
        for unit in self._all_units():
            unit.reshard()  # whatever a prefetch gathered but no backward used
        for handle in self._replica_sums.values():
            handle.wait()
        early, self._replica_sums = self._replica_sums, {}
        self.sum_over_replicas([flat.master.ensure_grad() for flat in self._flats() if id(flat) not in early],
                               self.offload.device)

    # ---- update -----------------------------------------------------------------------------------
    def _flats(self) -> list[FlatParam]:
        return [f for u in self._all_units() for f in u.flats]

    def _frozen(self) -> list[FrozenShard]:
        return [f for u in self._all_units() for f in u.frozen]

    def local_gradients(self) -> list[torch.Tensor]:
        return [flat.master.ensure_grad() for flat in self._flats()]

    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]:
        return [piece for flat in self._flats() for piece in flat.master.grad_pieces(self.held_placement)]

    @property
    def shards_gradients(self) -> bool:
        return True

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        flats = self._flats()
        factor = on_device_of(factor, [flat.master.grad for flat in flats])  # offloaded: a host copy
        for flat in flats:
            flat.master.grad.mul_(factor)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for flat in self._flats():
                flat.refresh_device_shard()
        if self.persistent is not None:
            self.persistent.gathered = False  # stale: regathered by the next forward

    def zero_grad(self) -> None:
        self._first_in_window = True  # the first reduction of the next window overwrites the shards


class _InputsDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward, run once autograd has every gradient of them, says so: the
    unit's backward is then over (FSDP2's post-backward function). An autograd node and not a tensor hook: a
    multi-tensor hook that keeps the inputs' nodes would keep every step's graph alive through the hook."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def watch_inputs(unit, args: tuple, kwargs: dict, ready) -> tuple[tuple, dict] | None:
    """A unit's forward arguments with every tensor that needs a gradient passed through `_InputsDone`, which
    calls `ready(unit)` in the backward (None: no input needs one, the unit waits for its gradients only)."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    unit.expects_inputs = bool(positions)
    if not positions:
        return None
    watched = _InputsDone.apply(lambda: ready(unit), *(flat[i] for i in positions))
    for i, t in zip(positions, watched):
        flat[i] = t
    return tree_unflatten(flat, spec)

"""Sharded initialization (config `meta_init: "sharded"`): each rank draws only the parts of the parameters it keeps.

The default (`deferred.InitReplay`) gives every tensor, bit for bit, the value eager construction gives: it
replays construction on full-size temporaries of one module at a time, so every rank draws every random
number of the model and holds the largest module's tensors once while it initializes. `ShardedInit` gives up
that equality for the same distribution at a fraction of the work and transient memory, as FSDP2's
`init_weights` on DTensor shards does.

[Note: row blocks]
A parameter of more than `block_numel` elements is cut into blocks of whole rows (its first dimension); the
block size is a function of its shape only. A block's values come from the same calls the replay makes for
that parameter (its module's `reset_parameters()`, then the family's `init_module`; or `init_fn`), run on a
temporary of the block's rows (every other dimension full, so fan_in is the parameter's), with the random
generator seeded from (the random state construction started from, the parameter's name, the block's index).
A rank computes only the blocks its regions touch and copies the part it keeps, so at most one block is
transient, the values do not depend on the layout (the same seed gives the same model under any ZeRO stage,
dp, tp or pp), and replicas hold the same values. Smaller parameters and every buffer are one block: the
replay's calls on a full-size temporary, seeded the same way (a buffer computed from its shape, such as a
rotary table, comes out as eagerly).

What it guarantees: each block has the distribution its initialization gives a tensor of the block's shape.
That is the parameter's own distribution for every initialization that depends on the shape only through the
trailing dimensions: nn.Linear's and nn.Embedding's defaults, constants, N(0, σ), U(a, b) — all the built-in
families use. One that reads the first dimension (xavier, orthogonal, fan_out modes, nn.Embedding's
padding_idx row) would see the block's row count instead: keep the default replay for such a model, or pass
an `init_fn` that does not. The global random state is left as it was before the fill.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from paratrain.checkpoint.weights import Region
from paratrain.errors import Error
from paratrain.init.empty import RNG_ATTRIBUTE, model_tensors
from paratrain.init.replay import InitReplay, Scratch, direct_tensors, post_order, run_on_temporaries, tensor_names
from paratrain.model_spec import ModelSpec

BLOCK_NUMEL = 1 << 16  # elements per row block: the transient memory of one draw (256 KiB in fp32)

Call = tuple[nn.Module, Callable[[], None]]


def meta_init_source(how: str, template: nn.Module, spec: ModelSpec, init_fn: Callable[[nn.Module], None] | None):
    """The source that fills a meta model (config `meta_init`): eager construction's values, or sharded draws."""
    return (ShardedInit if how == "sharded" else InitReplay)(template, spec, init_fn)


class _NotWritten(Error, LookupError):
    """No call of a tensor's initialization wrote it (internal: caught here, and the fill reports its names as
    uninitialized)."""


class ShardedInit:
    """Fills the regions a rank keeps with values of the right distribution, drawn block by block (see the note)."""

    def __init__(self, template: nn.Module, spec: ModelSpec, init_fn: Callable[[nn.Module], None] | None = None,
                 rng_state: torch.Tensor | None = None, block_numel: int | None = None):
        self.template = template
        self.spec = spec
        self.init_fn = init_fn
        self.block_numel = block_numel or BLOCK_NUMEL  # read here, so a test can make the blocks small
        first = next((t for t in model_tensors(template)), None)
        state = rng_state if rng_state is not None else getattr(first, RNG_ATTRIBUTE, None)
        state = state if state is not None else torch.get_rng_state()  # bare meta device: the state now
        self.seed_bytes = hashlib.sha256(state.numpy().tobytes()).digest()
        self.names = tensor_names(template)  # id(tensor) -> every name it has (tied tensors: several)
        self.tensors = {id(t): t for t in model_tensors(template)}
        self.pre = list(template.named_modules())  # the order of the family's pass
        self.post = list(post_order(template))  # the order constructors finish
        self.direct = {id(m): {id(t) for t in direct_tensors(m)} for _, m in self.pre}
        self.scratch = Scratch()  # one block's temporaries, reused block after block (see Scratch)

    def check(self, regions: dict[str, list[Region]]) -> None:
        """Nothing to check before filling: the template is the model itself."""

    def fill(self, regions: dict[str, list[Region]]) -> list[str]:
        """Write every region; returns the names of tensors no initialization reached (to be refused)."""
        written: set[str] = set()
        # Sized up front: grown while a block is still referenced, two buffers would exist at once.
        self.scratch = Scratch(max((self._scratch_bytes(self.tensors[tid]) for tid, names in self.names.items()
                                    if any(regions.get(n) for n in names)), default=0))
        with torch.random.fork_rng(devices=[]):
            for tid, names in self.names.items():
                wanted = [(name, r) for name in names for r in regions.get(name, [])]
                if not wanted:
                    continue
                try:
                    self._fill_tensor(self.tensors[tid], names[0], [r for _, r in wanted])
                except _NotWritten:
                    continue
                written.update(name for name, _ in wanted)
        self.scratch = Scratch()  # the buffer is freed with the fill
        return sorted(n for n in regions if n not in written)

    def _calls(self, t: torch.Tensor) -> list[Call]:
        """What the replay runs that may write `t`, in its order (`deferred.InitReplay.fill`)."""
        holders = [(name, m) for name, m in self.pre if id(t) in self.direct[id(m)]]
        if self.init_fn is not None:
            return [(m, lambda m=m: self.init_fn(m)) for _, m in self.post if id(t) in self.direct[id(m)]]
        calls: list[Call] = []
        owner = holders[0][1]  # the module that registered it first: its constructor's value counts
        reset = getattr(owner, "reset_parameters", None)
        if callable(reset):
            calls.append((owner, reset))
        return calls + [(m, lambda n=n, m=m: self.spec.init_module(self.template, n, m)) for n, m in holders]

    def _scratch_bytes(self, t: torch.Tensor) -> int:
        """The most a block of `t` takes from the scratch: every call's module's temporaries (`_block`)."""
        return sum(Scratch.nbytes(self._stand_in_shape(x), x.dtype) for m, _ in self._calls(t)
                   for x in direct_tensors(m))

    def rows_per_block(self, t: torch.Tensor) -> int:
        """Rows of `t` per block: all of them for a buffer or a parameter of at most `block_numel` elements."""
        if t.dim() == 0:
            return 1
        if not isinstance(t, nn.Parameter) or t.numel() <= self.block_numel:
            return max(t.shape[0], 1)
        return max(1, self.block_numel // math.prod(t.shape[1:]))

    def _seed(self, name: str, block: int) -> int:
        digest = hashlib.sha256(self.seed_bytes + f"{name}#{block}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    def _block(self, t: torch.Tensor, name: str, calls: list[Call], index: int) -> torch.Tensor:
        """Block `index` of `t` (rows index * rows_per_block onward), from the calls on temporaries."""
        rows = self.rows_per_block(t)
        shape = tuple(t.shape) if t.dim() == 0 else (min(rows, t.shape[0] - index * rows), *t.shape[1:])
        torch.manual_seed(self._seed(name, index))
        self.scratch.reset()  # the block drawn before is written out and dropped (`_fill_tensor`)
        value = None
        for module, call in calls:
            def temporary(x: torch.Tensor, current: torch.Tensor | None = value) -> torch.Tensor:
                if x is not t:
                    return self.scratch.take(self._stand_in_shape(x), x.dtype)
                return current if current is not None else self.scratch.take(shape, x.dtype)

            for original, new in run_on_temporaries(module, call, temporary):
                if original is t:
                    value = new
        if value is None:
            raise _NotWritten(name)
        return value

    def _stand_in_shape(self, other: torch.Tensor) -> tuple[int, ...]:
        """The temporary a module's other tensors get while one of its tensors is drawn (one block's size)."""
        if other.dim() == 0 or other.numel() <= self.block_numel:
            return tuple(other.shape)
        return (self.rows_per_block(other), *other.shape[1:])

    def _fill_tensor(self, t: torch.Tensor, name: str, regions: list[Region]) -> None:
        calls = self._calls(t)
        cached: dict[int, torch.Tensor] = {}

        def block(index: int) -> torch.Tensor:  # the last block drawn is kept: regions come in row order
            if index not in cached:
                cached.clear()
                cached[index] = self._block(t, name, calls, index)
            return cached[index]

        rows = self.rows_per_block(t)
        block(first_block(regions[0], rows))  # written at all? (raises _NotWritten before any region is touched)
        for region in regions:
            write_region(region, tuple(t.shape), rows, block)


def first_block(region: Region, rows: int) -> int:
    """The first row block `region` reads (blocks of `rows` rows of the whole tensor)."""
    box, off = region.origin.local_shape, region.origin.offsets
    return 0 if not box else (off[0] + region.start // max(1, math.prod(box[1:]))) // rows


def write_region(region: Region, shape: tuple[int, ...], rows: int, block: Callable[[int], torch.Tensor]) -> None:
    """Copy `region` of a tensor of `shape` from its row blocks (`block(k)`: rows [k * rows, (k + 1) * rows)),
    one block at a time. The part of a box past the tensor (an uneven vocabulary's padding) is zeros."""
    dest = region.dest
    dest.zero_()
    box, off = region.origin.local_shape, region.origin.offsets
    if region.end <= region.start:  # nothing of this tensor here (an empty tensor)
        return
    if not box:  # a 0-d tensor
        dest.copy_(block(0).reshape(1))
        return
    row = math.prod(box[1:])
    first, last = off[0] + region.start // row, min(off[0] - (-region.end // row), shape[0])  # original rows
    trail = tuple(slice(o, max(o, min(o + n, s))) for o, n, s in zip(off[1:], box[1:], shape[1:]))
    inner = tuple(slice(0, sl.stop - sl.start) for sl in trail)
    whole_rows = tuple(box[1:]) == shape[1:] and not any(off[1:])  # a ZeRO shard, a split of dimension 0
    for k in range(first // rows, -(-last // rows)):
        lo = k * rows
        a, b = max(lo, first), min(lo + rows, last)
        if whole_rows:  # the block's rows are the piece: no buffer for it
            piece = block(k)[a - lo:b - lo]
        else:
            piece = torch.zeros((b - a, *box[1:]), dtype=dest.dtype)
            piece[(slice(None), *inner)] = block(k)[(slice(a - lo, b - lo), *trail)]
        p0 = (a - off[0]) * row  # where the piece starts in the box, flattened
        s, e = max(p0, region.start), min(p0 + piece.numel(), region.end)
        dest[s - region.start:e - region.start].copy_(piece.reshape(-1)[s - p0:e - p0])

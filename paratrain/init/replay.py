"""Deferred initialization: build a model on the meta device; each rank materializes only what it keeps.

    with paratrain.init_empty():                   # or torch.device("meta"), or paratrain.zero.Init()
        model = Llama("llama3-8b")                  # no memory: every tensor is on the meta device
    engine, *_ = paratrain.initialize(model=model, config=cfg)

`parallelize` splits the meta model as it splits any other (TP slices, the pipeline split, ZeRO shards), then
allocates only this rank's part; the engine fills it from a weights file (`checkpoint.load_weights`) or, by
default, from `InitReplay`: the initialization the model would have had on the CPU.

[Note: bit-equal to eager construction]
Eager construction draws random numbers in a fixed order: every module's `reset_parameters()` as its
constructor finishes (children before parents), then the family's own pass over `named_modules()` (GPT-2's
N(0, 0.02): `ModelSpec.init_module`). `InitReplay` replays exactly that order on a copy of the meta model,
from the random state the construction started from (recorded by `init_empty`; with a bare
`torch.device("meta")`, the state at `initialize`). One module at a time gets full-size temporaries for its
own tensors, runs the same call, and hands each tensor's value to the regions this rank keeps, so each rank
holds at most its local state plus one module's tensors, and every rank computes the same numbers. A
tensor shared by two modules (tied embeddings) takes its constructor value from the module that registered
it first, as eagerly. With `init_fn(module)` given, that runs instead, module by module in the same order.
A tensor nobody initialized is an error that names it.
"""

from __future__ import annotations

import copy
import ctypes
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from paratrain.adapters.tensors import adapter_submodules
from paratrain.checkpoint.weights import Region, write_regions
from paratrain.init.empty import RNG_ATTRIBUTE, has_meta_tensors, model_tensors
from paratrain.model_spec import ModelSpec


def template_of(model: nn.Module) -> nn.Module | None:
    """A copy of a meta model's structure (free: it holds no data), taken before `parallelize` changes the
    model: what `InitReplay` runs the constructors' initialization on. None for a model with real tensors."""
    return structural_copy(model) if has_meta_tensors(model) else None


def return_freed_heap() -> None:
    """Give the pages of freed heap memory back to the OS (glibc's `malloc_trim`; nothing elsewhere).

    Called once a meta model's local state is allocated and before its values are written: building the
    strategies leaves freed small and mid-sized blocks that glibc keeps resident (1.6 MiB per rank, measured
    on a 24-layer llama-mini under ZeRO-3 dp4), and they would add to the peak the writes reach."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to do
        return
    libc.malloc_trim(0)


def structural_copy(model: nn.Module) -> nn.Module:
    """`module`'s tree with modules of their own: each has its own parameter, buffer and child dicts, holding
    copies of the tensors (deep copies: a meta tensor's costs no data), and shares every other attribute (its
    config, its hook dicts) with the original. A plain attribute that refers to a copied tensor (Hugging
    Face's `original_inv_freq`) refers to the copy, as in a deep copy.

    Why not `copy.deepcopy`: it also copies each module's dozen hook dicts, about 4,000 of them for a
    24-layer model, and with them 1.4 MiB of every rank's peak at init. The template never runs a forward,
    only the initialization calls, which read the tensors and the attributes and write the tensors."""
    memo: dict[int, object] = {}
    pairs: list[tuple[nn.Module, nn.Module]] = []
    root = _copy_modules(model, memo, pairs)
    for original, twin in pairs:  # once every tensor is copied: plain attributes naming one name its copy
        for key, value in original.__dict__.items():
            if isinstance(value, torch.Tensor) and id(value) in memo:
                twin.__dict__[key] = memo[id(value)]
    return root


def _copy_modules(module: nn.Module, memo: dict[int, object], pairs: list) -> nn.Module:
    if id(module) in memo:  # shared modules stay shared
        return memo[id(module)]
    twin = object.__new__(type(module))
    memo[id(module)] = twin
    pairs.append((module, twin))
    state = dict(module.__dict__)
    state["_parameters"] = {k: _tensor_copy(t, memo) for k, t in module._parameters.items()}
    state["_buffers"] = {k: _tensor_copy(t, memo) for k, t in module._buffers.items()}
    state["_modules"] = {k: None if c is None else _copy_modules(c, memo, pairs) for k, c in module._modules.items()}
    twin.__dict__.update(state)
    return twin


def _tensor_copy(t: torch.Tensor | None, memo: dict[int, object]) -> torch.Tensor | None:
    """A deep copy that keeps the tensor's attributes (a meta Parameter's deep copy drops them, and with them
    the random state `init_empty` recorded: the replay would then start from the state at `initialize`)."""
    if t is None:
        return None
    twin = copy.deepcopy(t, memo)
    for key, value in vars(t).items():
        if not hasattr(twin, key):
            setattr(twin, key, value)
    return twin


def post_order(module: nn.Module, prefix: str = "", seen: set | None = None) -> Iterator[tuple[str, nn.Module]]:
    """Children before their parent, in registration order: the order constructors finish."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, child in module.named_children():
        yield from post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def tensor_names(template: nn.Module) -> dict[int, list[str]]:
    """{id(tensor): every name it has} (tied tensors: several), parameters first, in registration order."""
    names: dict[int, list[str]] = {}
    for name, t in [*template.named_parameters(remove_duplicate=False),
                    *template.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return names


def direct_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers `module` itself registered (not its children's)."""
    return [t for store in (module._parameters, module._buffers) for t in store.values() if t is not None]


def run_on_temporaries(module: nn.Module, call: Callable[[], None],
                       temporary: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`call()` with each of the module's own tensors `t` replaced by `temporary(t)` (a real tensor); returns
    (t, its value) for every tensor the call wrote: replaced it, or changed it in place (its version moved). A
    tensor the call left alone keeps the value an earlier call gave it."""
    slots = [(store, key, t) for store in (module._parameters, module._buffers) for key, t in store.items()
             if t is not None]
    if not slots:  # nothing to stand in for: the call is not made (it could only reach other modules' tensors)
        return []
    temps = []
    for store, key, t in slots:
        temp = temporary(t)
        store[key] = nn.Parameter(temp, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else temp
        temps.append((store[key], store[key]._version))
    try:
        with torch.no_grad():
            call()
        return [(t, store[key].detach()) for (store, key, t), (temp, version) in zip(slots, temps)
                if store[key] is not temp or temp._version != version]
    finally:
        for store, key, t in slots:
            store[key] = t


class Scratch:
    """Temporaries carved from one reused buffer, each a tensor of its own (own version counter, so
    `run_on_temporaries` still sees which of them a call wrote).

    Why not `torch.empty` per temporary: the replay allocates and frees tensors of 4-125 MiB module after
    module, and glibc serves the ones under its mmap threshold (which rises to 32 MiB as big blocks are freed)
    from its heap, then keeps up to twice that threshold of freed heap resident: 22 MiB more per rank at the
    peak of a 350M Llama's init. One buffer, sized once for the largest request, is allocated once and
    freed once. `reset()` starts over (the previous temporaries are dead by then) and grows the buffer to the
    most a round asked for; a request past the buffer gets a tensor of its own meanwhile."""

    ALIGN = 64  # bytes: every temporary starts on an aligned address, as torch's allocations do

    def __init__(self, capacity: int = 0):
        self.buffer = torch.empty(capacity, dtype=torch.uint8)
        self.used = 0
        self.wanted = capacity

    @staticmethod
    def nbytes(shape, dtype: torch.dtype) -> int:
        return -(-math.prod(shape) * dtype.itemsize // Scratch.ALIGN) * Scratch.ALIGN

    def reset(self) -> None:
        if self.wanted > self.buffer.numel():
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes first: never two at once
            self.buffer = torch.empty(self.wanted, dtype=torch.uint8)
        self.used = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        start, size = self.used, self.nbytes(shape, dtype)
        self.used += size
        self.wanted = max(self.wanted, self.used)
        if self.used > self.buffer.numel() or start % dtype.itemsize:
            return torch.empty(shape, dtype=dtype)
        strides, step = [], 1
        for size in reversed(tuple(shape)):  # contiguous, as torch.empty's
            strides.insert(0, step)
            step *= max(size, 1)
        out = torch.empty(0, dtype=dtype)
        return out.set_(self.buffer.untyped_storage(), start // dtype.itemsize, tuple(shape), tuple(strides))


class InitReplay:
    """Fills the regions a rank keeps with the values eager construction gives (see the module's note)."""

    def __init__(self, template: nn.Module, spec: ModelSpec, init_fn: Callable[[nn.Module], None] | None = None,
                 rng_state: torch.Tensor | None = None):
        self.template = template
        self.spec = spec
        self.init_fn = init_fn
        first = next((t for t in model_tensors(template)), None)
        self.rng_state = rng_state if rng_state is not None else getattr(first, RNG_ATTRIBUTE, None)
        self.names = tensor_names(template)  # id(tensor) -> every name it has (tied tensors: several)
        self.owner: dict[int, int] = {}  # id(tensor) -> id(the module that registered it first)
        self.scratch = Scratch()  # the temporaries' bytes (sized by `fill`)
        for module in template.modules():
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if t is not None:
                    self.owner.setdefault(id(t), id(module))

    def check(self, regions: dict[str, list[Region]]) -> None:
        """Nothing to check before filling: the template is the model itself."""

    def fill(self, regions: dict[str, list[Region]]) -> list[str]:
        """Write every region; returns the names of tensors no initialization reached (to be refused)."""
        if self.rng_state is not None:
            torch.set_rng_state(self.rng_state)
        written: set[str] = set()
        # Sized for the module with the most bytes of its own (a 350M Llama's head: 125 MiB), freed at the end.
        self.scratch = Scratch(max((sum(Scratch.nbytes(t.shape, t.dtype) for t in direct_tensors(m))
                                    for m in self.template.modules()), default=0))
        # Adapters were put in after construction: their modules' constructors drew nothing in its order, and
        # their values come from their names (paratrain.init.adapters), so the replay passes them by.
        adapters = adapter_submodules(self.template)
        if self.init_fn is not None:
            for _, module in post_order(self.template):
                if id(module) not in adapters:
                    self._run(module, lambda m=module: self.init_fn(m), regions, written, owned_only=False)
        else:
            for _, module in post_order(self.template):
                reset = getattr(module, "reset_parameters", None)
                if callable(reset) and id(module) not in adapters:
                    self._run(module, reset, regions, written, owned_only=True)
            for name, module in self.template.named_modules():
                if id(module) not in adapters:
                    self._run(module, lambda n=name, m=module: self.spec.init_module(self.template, n, m), regions,
                              written, owned_only=False)
        self.scratch = Scratch()  # the buffer is freed with the fill
        return sorted(n for n in regions if n not in written)

    def _run(self, module: nn.Module, call: Callable[[], None], regions: dict[str, list[Region]], written: set,
             owned_only: bool) -> None:
        """`call()` with the module's own tensors as full-size CPU temporaries; their values then go to the
        regions of every name they have (`owned_only`: only tensors this module registered first)."""
        self.scratch.reset()  # the last module's temporaries are written out: their bytes are reused
        values = run_on_temporaries(module, call, lambda t: self.scratch.take(t.shape, t.dtype))
        for original, value in values:
            if owned_only and self.owner.get(id(original)) != id(module):
                continue
            for name in self.names.get(id(original), []):
                write_regions(value, regions.get(name, []))
                written.add(name)

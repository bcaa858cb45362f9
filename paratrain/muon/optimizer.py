"""`Muon`: torch's Muon for the groups marked `use_muon`, torch's AdamW for the others, in one optimizer (as
DeepSpeed's MuonWithAuxAdam takes its param groups), on whole parameters or on the shards a strategy updates.

One process (or DDP, stage 0) gets exactly `torch.optim.Muon` + `torch.optim.AdamW` on the same groups. Under
ZeRO, tensor or expert parallelism the strategy binds a `MatrixSet` (`bind`), which orthogonalizes each whole
matrix once per step from the parts the ranks hold. The state is torch's: `momentum_buffer` per Muon tensor (one
buffer, where AdamW keeps two), AdamW's `exp_avg`, `exp_avg_sq`, `step` for the others; a checkpoint reshards it
like any optimizer state.
"""

from __future__ import annotations

import torch

from paratrain.errors import InvalidValueError
from paratrain.muon.layout import MasterLayout, Piece
from paratrain.muon.matrices import MatrixSet
from paratrain.muon.newton_schulz import DEFAULT_COEFFICIENTS, NS_DTYPES, lr_ratio, momentum_update, orthogonalize

MUON_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                 "ns_coefficients": DEFAULT_COEFFICIENTS, "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None,
                 "ns_dtype": "bfloat16"}
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class Muon(torch.optim.Optimizer):
    """Muon (torch's arithmetic) on the `use_muon` groups, AdamW on the rest. Beyond torch's options, `ns_dtype`
    ("bfloat16", torch's, or "float32") is the dtype of the Newton-Schulz iteration (see `newton_schulz`'s note).

    A group without `use_muon` is Muon's when every tensor in it is 2-d (one process only: `bind` refuses such
    groups, since a strategy's shards are 1-d whatever they hold). An AdamW group's options are
    its own, with `adamw` (a dict of AdamW's options: lr, betas, eps, weight_decay) under them: Muon's `eps` and
    `lr` are not AdamW's.
    """

    def __init__(self, params, adamw: dict | None = None, **muon_options):
        unknown = sorted(set(muon_options) - set(MUON_DEFAULTS))
        if unknown:
            raise InvalidValueError(f"Muon got unknown option(s) {unknown}; it takes {sorted(MUON_DEFAULTS)} and "
                                    f"'adamw' (the AdamW part's options)")
        if muon_options.get("ns_dtype", "bfloat16") not in NS_DTYPES:
            raise InvalidValueError(f"Muon ns_dtype = {muon_options['ns_dtype']!r}: use one of {sorted(NS_DTYPES)}")
        adjust = muon_options.get("adjust_lr_fn")
        if adjust not in (None, "original", "match_rms_adamw"):
            raise InvalidValueError(f"Muon adjust_lr_fn = {adjust!r}: use null, 'original' or 'match_rms_adamw'")
        self.adamw_defaults = {**ADAMW_DEFAULTS, **(adamw or {})}
        # AdamW's own keys (amsgrad, maximize, foreach, ...) for the AdamW groups, from an AdamW over a stand-in.
        self._adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **self.adamw_defaults)
        self._guessed: set[int] = set()  # groups whose use_muon was guessed from their tensors' shapes
        super().__init__(params, {**MUON_DEFAULTS, **muon_options})
        self.matrices: MatrixSet | None = None

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "matrices", None) is not None:
            raise InvalidValueError("Muon.add_param_group after the engine bound it: its tensors' layouts are fixed "
                                    "then; pass every group to initialize(model_parameters=...)")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group = {**param_group, "params": params}
        if "use_muon" not in group:  # one process: a plain matrix is Muon's; a strategy's tensors say nothing
            group["use_muon"] = all(p.dim() == 2 for p in params)
            self._guessed.add(len(self.param_groups))
        if group["use_muon"]:
            super().add_param_group(group)
        else:
            own = {k: group.pop(k) for k in list(group) if k in ADAMW_DEFAULTS}  # not Muon's lr, eps, ...
            super().add_param_group(group)
            self.param_groups[-1].update({**self._adamw.defaults, **self.adamw_defaults, **own})
        self._link_adamw()

    def _link_adamw(self) -> None:
        """The AdamW part steps this optimizer's own AdamW groups (the same dicts: a scheduler's lr reaches
        them) with this optimizer's state (one state dict, one checkpoint)."""
        self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: link them again
        self._link_adamw()

    def __getstate__(self) -> dict:  # torch keeps defaults, state and groups only: the AdamW part's options too
        return {**super().__getstate__(), "adamw_defaults": self.adamw_defaults}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **self.adamw_defaults)
        self.matrices, self._guessed = None, set()  # a copy steps whole tensors until bound again
        self._link_adamw()

    def bind(self, masters: list[torch.Tensor], layouts: list[MasterLayout], tp, device: torch.device) -> None:
        """Orthogonalize through `MatrixSet` from now on: `layouts[i]` says what `masters[i]` holds (a strategy
        whose optimizer tensors are not whole parameters calls this after building the optimizer)."""
        if self._guessed:
            raise InvalidValueError("a Muon optimizer over a strategy's tensors (ZeRO shards, tp slices) needs "
                                    "use_muon in every param group, which its tensors cannot tell; set the config's "
                                    "optimizer to {\"type\": \"Muon\"} and paratrain makes the groups from the model "
                                    "(or give initialize() groups with use_muon)")
        muon = {id(p) for g in self.param_groups if g["use_muon"] for p in g["params"]}
        kept = [(m, layout) for m, layout in zip(masters, layouts) if id(m) in muon]
        self.matrices = MatrixSet([m for m, _ in kept], [layout for _, layout in kept], tp, device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
        if self._adamw.param_groups:
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        # Every tensor steps, with a zero gradient if none came: under ZeRO the ranks must take part in the
        # same gathers whatever their shards received (a zero gradient is what a sharded strategy holds then).
        params = [p for p in group["params"] if p.grad is not None or self.matrices is not None]
        if not params:
            return
        updates = []
        for p in params:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            updates.append(momentum_update(grad, state["momentum_buffer"], group["momentum"], group["nesterov"]))
        options = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"], NS_DTYPES[group["ns_dtype"]])
        if self.matrices is None:
            orthogonal = [orthogonalize(u, *options) for u in updates]
            spans = [[(0, p.numel(), lr_ratio(tuple(p.shape), group["adjust_lr_fn"]))] for p in params]
        else:
            orthogonal = self.matrices.orthogonalize(params, updates, *options)
            spans = [self.matrices.layout_of(p).lr_spans(group["adjust_lr_fn"]) for p in params]
        lr = group["lr"]
        for p, o, pieces in zip(params, orthogonal, spans):
            p.mul_(1 - lr * group["weight_decay"])
            flat, step = p.view(-1), o.reshape(-1)
            for start, end, ratio in pieces:
                flat[start:end].add_(step[start:end], alpha=-lr * ratio)


def whole_parameter_layout(param: torch.Tensor, placement) -> MasterLayout:
    """The layout of a master that is one whole local parameter."""
    return MasterLayout((Piece(0, tuple(param.shape), placement),), param.numel())

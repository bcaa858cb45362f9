"""The shape of the model being planned: a GPT or Llama preset, its config, or a paratrain JSON config naming one.

Everything the cost model needs is a count derived from `GPTConfig` (never from building the model), so
a 70B model is planned in microseconds. `GPTConfig.num_params()` is exact for `paratrain.models.GPT`; the
split of those parameters into sharded and replicated parts follows the tensor-parallel plan below.

[Note: the tensor-parallel split]
Megatron's plan for a GPT block, which paratrain's TP plan follows (`models/gpt/shape.GPT_PLAN`): q, k, v and mlp.fc are
column-parallel (weight and bias split over tp), attn.o and mlp.proj are row-parallel (weight split, bias
replicated), layer norms are replicated. The token embedding is vocab-parallel and the head column-parallel
over the vocabulary (vocab-parallel loss); the position embedding and the final norm are replicated.
`tests/unit/test_planner_model.py` checks these counts against a real `Block` with that plan's patterns (the
planner keeps no copy of it).

A Llama (`LlamaConfig`) is counted by its own shapes: q and o of n_head heads, k and v of n_kv_head heads,
a three-matrix SwiGLU MLP, RMSNorm weights only, no biases, no position table, the head tied or not. Its
activation memory is the GPT formula with the SwiGLU's four (s, b, d_ff) intermediates in place of the GELU
MLP's two; unlike the GPT's, it is not calibrated against measured runs.

A Llama MoE (`LlamaMoEConfig`) counts its total and active parameters with the config's own `num_params()` /
`active_params()`; FLOPs use the active ones (`LlamaMoEConfig.flops_per_token`). Its first n_dense_layers
blocks are Llama blocks; every other block splits into a dense part (attention split over tp as the Llama's,
norms, the router and the shared experts, the latter two whole on every tp rank: paratrain's MoE TP plan) and
its routed experts (`expert_block_params`, split over ep, never over tp). See docs/planner.md, "MoE".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paratrain.errors import Error
from paratrain.models.gpt.model import PRESETS as GPT_PRESETS
from paratrain.models.gpt.model import GPTConfig
from paratrain.models.llama.model import PRESETS as LLAMA_PRESETS
from paratrain.models.llama.model import LlamaConfig
from paratrain.models.llama_moe.model import PRESETS as LLAMA_MOE_PRESETS
from paratrain.models.llama_moe.model import LlamaMoEConfig
from paratrain.models.registry import preset_config
from paratrain.planner.adapters import LoraPlan, layer_adapter_params, projections

PRESETS = {**GPT_PRESETS, **LLAMA_PRESETS, **LLAMA_MOE_PRESETS}

class PlannerError(Error, ValueError):
    """A planning request that cannot be answered; the message names the flag and the fix."""


@dataclass(frozen=True)
class ReferencePlan:
    """The objective the plan costs (its config section) and where its reference log-probs come from."""

    objective: dict
    mode: str  # "initial" | "adapters_off" | "batch" | "none" (the objective reads no reference)

    @property
    def copy(self) -> bool:
        """A frozen second copy of the weights sits beside the policy."""
        return self.mode == "initial"

    @property
    def forward(self) -> bool:
        """Each micro-batch runs a reference forward in the step."""
        return self.mode in ("initial", "adapters_off")

    def describe(self) -> str:
        what = {"initial": "a frozen copy of the initial weights (in params)",
                "adapters_off": "the policy with its adapters off (no copy)",
                "batch": "log-probs the batch carries (no copy, no forward)", "none": "none"}[self.mode]
        return f"objective: {self.objective.get('type', 'sft')}, reference: {what}"


@dataclass(frozen=True)
class ModelShape:
    """A GPT's or Llama's dimensions and parameter counts, and how to name it in a paratrain config."""

    name: str  # preset the config's trainer.model names
    config: GPTConfig | LlamaConfig | LlamaMoEConfig
    overrides: dict = field(default_factory=dict)  # trainer.model_overrides relative to the preset
    lora: LoraPlan | None = None  # adapters over a frozen base (planner/adapters.py), or full training
    reference: ReferencePlan | None = None  # an objective's reference model (planner/reference.py), or none

    # ---- dimensions (the letters of Korthikanti et al.: s, h, a, L, V) ----------------------------
    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def d_model(self) -> int:
        return self.config.d_model

    @property
    def n_head(self) -> int:
        return self.config.n_head

    @property
    def n_layer(self) -> int:
        return self.config.n_layer

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def d_ff(self) -> int:
        return self.config.d_ff

    @property
    def llama(self) -> bool:
        return isinstance(self.config, LlamaConfig)

    @property
    def moe(self) -> bool:
        return isinstance(self.config, LlamaMoEConfig)

    @property
    def n_kv_head(self) -> int:
        return self.config.n_kv_head if self.llama else self.n_head

    @property
    def dropout(self) -> float:
        return getattr(self.config, "dropout", 0.0)

    @property
    def mlp_intermediates(self) -> int:
        """(s, b, d_ff) tensors one MLP keeps for backward: GELU's input and output; SwiGLU's gate, up, silu
        and their product."""
        return 4 if self.llama else 2

    # ---- parameter counts -------------------------------------------------------------------------
    @property
    def params(self) -> int:
        return self.config.num_params()

    @property
    def active_params(self) -> int:
        """Parameters one token uses (`LlamaMoEConfig.active_params`); all of them for a dense model."""
        return self.config.active_params() if self.moe else self.params

    # ---- mixture of experts (all 0 / dense for a GPT or Llama) --------------------------------------
    @property
    def num_experts(self) -> int:
        return self.config.num_experts if self.moe else 0

    @property
    def top_k(self) -> int:
        return self.config.top_k if self.moe else 0

    @property
    def n_dense_layers(self) -> int:
        return self.config.n_dense_layers if self.moe else self.n_layer

    @property
    def n_moe_layers(self) -> int:
        return self.n_layer - self.n_dense_layers

    def expert_block_params(self, ep: int = 1) -> int:
        """Routed-expert parameters of one MoE block held by one ep rank: E/ep SwiGLU experts of width
        d_expert (stacked gate, up, down: 3 d d_expert each), whole on every tp rank."""
        if not self.moe:
            return 0
        return self.num_experts // ep * 3 * self.d_model * self.config.d_expert

    def moe_block_params(self, tp: int = 1) -> int:
        """The dense part of one MoE block on a tp rank: attention (/tp), two RMSNorms, the router (d x E) and
        the shared experts (whole on every tp rank). 0 for a dense model."""
        if not self.moe:
            return 0
        cfg, h = self.config, self.d_model
        attention = (2 * h * self.n_head * cfg.head_dim + 2 * h * self.n_kv_head * cfg.head_dim) // tp
        return attention + 2 * h + h * self.num_experts + cfg.shared_experts * 3 * h * cfg.d_expert

    def active_moe_block_params(self) -> int:
        """Parameters of one MoE block a token uses: its dense part and top_k routed experts."""
        return self.moe_block_params() + self.top_k * 3 * self.d_model * self.config.d_expert

    def moe_mlp_params(self) -> int:
        """The part of an MoE block a token uses that runs whole on every tp rank (paratrain's MoE TP plan):
        the router, the shared experts and top_k routed experts."""
        if not self.moe:
            return 0
        cfg, h = self.config, self.d_model
        return h * self.num_experts + (cfg.shared_experts + self.top_k) * 3 * h * cfg.d_expert

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer block held by one tensor-parallel rank (a dense block of an MoE
        model: see `moe_block_params` and `expert_block_params` for its MoE blocks)."""
        if self.llama:
            h, f, hd = self.d_model, self.d_ff, self.config.head_dim
            return (2 * h * self.n_head * hd + 2 * h * self.n_kv_head * hd + 3 * h * f) // tp + 2 * h
        h, f, b = self.d_model, self.d_ff, int(self.config.bias)
        sharded = 4 * h * h + 2 * h * f + b * (3 * h + f)  # q, k, v, fc (weights + biases), o, proj weights
        replicated = 4 * h + b * 2 * h  # two layer norms, the row-parallel biases of o and proj
        return sharded // tp + replicated

    def embed_params(self, tp: int = 1) -> int:
        positions = 0 if self.llama else self.seq_len * self.d_model
        return self.vocab_size * self.d_model // tp + positions

    def head_params(self, tp: int = 1) -> int:
        """The final layer norm (replicated) and the output projection (split over the vocabulary)."""
        if self.llama:
            head = 0 if self.config.tie_embeddings else self.d_model * self.vocab_size // tp
            return self.final_norm_params() + head
        h, v, b = self.d_model, self.vocab_size, int(self.config.bias)
        return 2 * h + (h * v + b * v) // tp

    def layernorm_params_per_layer(self) -> int:
        return (2 if self.llama else 4) * self.d_model

    def final_norm_params(self) -> int:
        return (1 if self.llama else 2) * self.d_model

    def largest_module_params(self) -> int:
        """Parameters of the largest single module (DeepSpeed's `largest_layer_params`)."""
        if self.moe:  # a stacked (E, out, in) expert tensor is one module's parameter
            return max(self.vocab_size * self.d_model, self.d_model * self.d_ff,
                       self.num_experts * self.d_model * self.config.d_expert)
        if self.llama:
            return max(self.vocab_size * self.d_model, self.d_model * self.d_ff)
        h, f, v, b = self.d_model, self.d_ff, self.vocab_size, int(self.config.bias)
        return max(v * h, h * v + b * v, h * f + b * f, self.seq_len * h)

    # ---- FLOPs ------------------------------------------------------------------------------------
    @property
    def flops_per_token(self) -> int:
        """6 per parameter (forward + backward) + attention scores/values: `GPTConfig.flops_per_token`. Through
        adapters the frozen base needs no weight gradient (4 per parameter) and the adapters all 6."""
        flops = self.config.flops_per_token()
        if self.lora is None:
            return flops
        matmul = (flops - 12 * self.n_layer * self.d_model * self.seq_len) // 6
        return flops - 2 * matmul + 6 * self.n_layer * layer_adapter_params(self)

    def attention_flops_per_token_per_layer(self) -> int:
        """QK^T and AV: 2*s*h each forward, times 3 for forward + backward (the 12*s*h of flops_per_token)."""
        return 12 * self.d_model * self.seq_len

    def describe(self) -> str:
        count = f"{format_count(self.params)} parameters" + \
            (f" ({format_count(self.active_params)} active)" if self.moe else "")
        kv = f" ({self.n_kv_head} k/v)" if self.llama else ""
        moe = ""
        if self.moe:
            shared = self.config.shared_experts
            moe = (f", {self.n_moe_layers} MoE blocks of {self.num_experts} experts top-{self.top_k} d_expert "
                   f"{self.config.d_expert}" + (f" +{shared} shared" if shared else ""))
        lora = f"; {'DoRA' if self.lora.dora else 'LoRA'} r={self.lora.r} on {','.join(self.lora.targets)}: " \
            f"{format_count(self.n_layer * layer_adapter_params(self))} trainable, the base frozen" if self.lora else ""
        return (f"{self.name}{'*' if self.overrides else ''}: {count}, "
                f"{self.n_layer} layers, d_model {self.d_model}, {self.n_head} heads{kv}, d_ff {self.d_ff}, "
                f"seq {self.seq_len}, vocab {self.vocab_size}{moe}{lora}")


def format_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def shape_from_config(config: GPTConfig | LlamaConfig | LlamaMoEConfig, name: str = "custom") -> ModelShape:
    """A shape for an explicit config; `name` is the preset it is expressed against (or the family's tiny one)."""
    _refuse_unplanned(config, name)
    tiny = {LlamaMoEConfig: "mixtral-tiny", LlamaConfig: "llama-tiny"}.get(type(config), "gpt-tiny")
    base_name = name if name in PRESETS and type(PRESETS[name]) is type(config) else tiny
    base = asdict(PRESETS[base_name])
    overrides = {k: v for k, v in asdict(config).items() if base[k] != v}
    return ModelShape(base_name, config, overrides)


def model_shape(model: str, seq_len: int | None = None) -> ModelShape:
    """`model` is a preset name (gpt-7b, gpt-70b, ...) or the path of a paratrain JSON config whose
    `trainer.model` / `trainer.model_overrides` name a GPT. `seq_len` replaces the sequence length."""
    if model in PRESETS:
        name, overrides = model, {}
    else:
        path = Path(model)
        if not path.is_file():
            raise PlannerError(f"--model {model!r} is neither a GPT preset nor a Llama or Llama MoE preset "
                               f"({', '.join(PRESETS)}) nor a config file")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise PlannerError(f"--model {model!r}: not valid JSON ({exc})") from None
        trainer = raw.get("trainer", {}) if isinstance(raw, dict) else {}
        name = trainer.get("model", "gpt-tiny")
        overrides = dict(trainer.get("model_overrides", {}))
    if seq_len is not None:
        overrides["seq_len"] = seq_len
    try:
        config = preset_config(name, **overrides)
    except ValueError as exc:
        raise PlannerError(f"--model {model!r}: {exc}") from None
    _refuse_unplanned(config, name)
    return ModelShape(name, config, overrides)


def _refuse_unplanned(config, name: str) -> None:
    # exact types: a subclass (a LlamaMoEConfig is a LlamaConfig) counted as its parent would lose parameters
    if type(config) not in (GPTConfig, LlamaConfig, LlamaMoEConfig):
        raise PlannerError(f"--model {name!r} is a {type(config).__name__}: the planner costs GPT, Llama and "
                           f"Llama MoE models only")


def config_batch_size(model: str) -> int | None:
    """The train_batch_size of a config file given as --model, if it sets one (the default global batch)."""
    path = Path(model)
    if model in PRESETS or not path.is_file():
        return None
    value = json.loads(path.read_text()).get("train_batch_size")
    return int(value) if isinstance(value, int) else None


def with_adapters(shape: ModelShape, plan: LoraPlan) -> ModelShape:
    """`shape` trained through adapters (`paratrain plan --lora-r`); targets it has no projection of are refused."""
    unknown = [t for t in plan.targets if t not in projections(shape)]
    if unknown:
        raise PlannerError(f"--lora-targets {unknown} are not projections of {shape.name}; use some of "
                           f"{list(projections(shape))}")
    if shape.moe:
        raise PlannerError(f"--lora-r with {shape.name}: the planner costs adapters on dense models only")
    return ModelShape(shape.name, shape.config, shape.overrides, plan, shape.reference)


def with_reference(shape: ModelShape, reference: ReferencePlan | None) -> ModelShape:
    """`shape` trained by an objective with this reference (`paratrain plan --objective`; None: none)."""
    return ModelShape(shape.name, shape.config, shape.overrides, shape.lora, reference)

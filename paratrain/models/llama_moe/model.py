"""Mixture-of-experts variants of the Llama family: the Llama's attention, norms and rotary positions, with
`paratrain.moe.MoELayer` (SwiGLU experts) in place of the MLP.

    model = LlamaMoE("mixtral-tiny")     # every block MoE, top-2 of 4 softmax-routed experts (Mixtral)
    model = LlamaMoE("deepseek-tiny")    # first n_dense_layers blocks dense, sigmoid routing, a shared expert
    loss = model(idx, targets)           # cross-entropy + aux_loss_coef · aux + z_loss_coef · z
    logits = model(idx)

Routing is decided per group of `router_group_size` consecutive tokens of a sequence (default: the whole
sequence): each group has its own expert capacity and its own balancing loss (GShard's groups), so every
layout that keeps groups whole on one rank (data, pipeline, expert parallelism; context and sequence
parallelism when the group divides each rank's chunk) routes exactly as one process does.
`aux` and `z` are the means over the MoE blocks of each block's `load_balancing_loss` and `router_z_loss`
(`paratrain/moe/router.py` has the formulas), so a coefficient does not grow with depth; `model.last_losses`
keeps the last forward's values. Names follow Hugging Face's Mixtral/DeepSeek layout where it has one
(`model.layers.N.mlp.gate.gate.weight` is the router, `mlp.experts.{gate,up,down}_proj` the stacked experts
(E, out, in), `mlp.shared_experts.*` the shared expert); there is no Hugging Face conversion yet.
The published-shape presets are for parameter counts (`num_params`, `active_params`), not for building.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from paratrain.attention import Documents
from paratrain.data.micro_batch import add_to_loss
from paratrain.errors import InvalidValueError
from paratrain.models.gpt.model import TokenCrossEntropy, check_token_ids
from paratrain.models.llama.model import LlamaAttention, LlamaConfig, LlamaMLP, RMSNorm, init_module
from paratrain.models.presets import preset
from paratrain.moe import GroupedSwiGLU, MoELayer, MoEOutput
from paratrain.moe.router import SCORE_FUNCS


@dataclass(frozen=True)
class LlamaMoEConfig(LlamaConfig):
    num_experts: int = 4
    top_k: int = 2
    d_expert: int = 0  # each routed expert's SwiGLU width; 0: d_ff
    n_dense_layers: int = 0  # the first blocks keep a dense MLP of width d_ff (DeepSeek: 3)
    shared_experts: int = 0  # always-on experts of width d_expert per MoE block (DeepSeek: 1)
    score_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True
    capacity_factor: float | None = None  # None: dropless
    router_group_size: int = 0  # tokens per routing group (capacity and balancing loss per group); 0: seq_len
    aux_loss_coef: float = 0.01  # Switch Transformer's α
    z_loss_coef: float = 0.0  # ST-MoE uses 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_expert == 0:
            object.__setattr__(self, "d_expert", self.d_ff)
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidValueError(f"top_k ({self.top_k}) must be in [1, num_experts = {self.num_experts}]")
        if not 0 <= self.n_dense_layers <= self.n_layer:
            raise InvalidValueError(f"n_dense_layers ({self.n_dense_layers}) must be in [0, n_layer = "
                                    f"{self.n_layer}]")
        if self.router_group_size < 0 or self.seq_len % self.group_size:
            raise InvalidValueError(f"router_group_size ({self.router_group_size}) must divide seq_len "
                                    f"({self.seq_len}); 0 means one group per sequence")
        if self.score_func not in SCORE_FUNCS:
            raise InvalidValueError(f"score_func = {self.score_func!r}: use one of {SCORE_FUNCS}")

    @property
    def group_size(self) -> int:
        """Tokens per routing group: router_group_size, or the whole sequence."""
        return self.router_group_size or self.seq_len

    def _attention_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        return 2 * d * self.n_head * hd + 2 * d * self.n_kv_head * hd

    def _params(self, routed: int) -> int:
        """Parameters with `routed` routed experts per MoE block (all of them: total; top_k: active)."""
        d, v = self.d_model, self.vocab_size
        dense = 3 * d * self.d_ff
        moe = d * self.num_experts + (routed + self.shared_experts) * 3 * d * self.d_expert
        blocks = self.n_layer * (self._attention_params() + 2 * d) + self.n_dense_layers * dense
        blocks += (self.n_layer - self.n_dense_layers) * moe
        return v * d + blocks + d + (0 if self.tie_embeddings else v * d)

    def num_params(self) -> int:
        """Exact parameter count of `LlamaMoE(self)`."""
        return self._params(self.num_experts)

    def active_params(self) -> int:
        """Parameters one token uses: top_k routed experts per MoE block (and the whole router, the shared
        experts, attention, both token tables), as Mixtral's "12.9B active" counts them."""
        return self._params(self.top_k)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per active matmul parameter + attention over the sequence (Llama's)."""
        matmul = self.active_params() - self.vocab_size * self.d_model * (0 if self.tie_embeddings else 1)
        return 6 * matmul + 12 * self.n_layer * self.d_model * self.seq_len


PRESETS: dict[str, LlamaMoEConfig] = {
    "mixtral-tiny": LlamaMoEConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                                   d_ff=64, num_experts=4, top_k=2),
    "deepseek-tiny": LlamaMoEConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=4, n_kv_head=2, d_model=32,
                                    d_ff=96, d_expert=32, num_experts=8, top_k=2, n_dense_layers=1,
                                    shared_experts=1, score_func="sigmoid"),
    # Mistral's published Mixtral-8x7B shapes (46.7B total, 12.9B active)
    "mixtral-8x7b": LlamaMoEConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, n_kv_head=8,
                                   d_model=4096, d_ff=14336, rope_theta=1e6, num_experts=8, top_k=2),
    # DeepSeek-V3's published MoE shapes (61 blocks, 3 dense, 256 routed experts of 2048 + 1 shared, top-8,
    # sigmoid) with Llama attention (128 full heads of 56) in place of multi-head latent attention, which
    # paratrain does not have: about 672B total (published 671B), 38B active (published 37B)
    "deepseek-v3-shape": LlamaMoEConfig(vocab_size=129280, seq_len=4096, n_layer=61, n_head=128, n_kv_head=128,
                                        d_model=7168, d_ff=18432, d_expert=2048, num_experts=256, top_k=8,
                                        n_dense_layers=3, shared_experts=1, score_func="sigmoid"),
}


def llama_moe_config(name: str, **overrides) -> LlamaMoEConfig:
    """A preset by name, optionally with fields replaced (e.g. n_layer=2)."""
    return preset(PRESETS, "Llama MoE", "LlamaMoEConfig", name, overrides)


class LlamaMoEDecoderLayer(nn.Module):
    """The Llama block with an MoE MLP (a dense one when `dense`); keeps its router losses in `losses`."""

    def __init__(self, cfg: LlamaMoEConfig, dense: bool):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg) if dense else MoELayer(
            cfg.d_model, cfg.num_experts, cfg.d_expert, cfg.top_k, score_func=cfg.score_func,
            norm_topk_prob=cfg.norm_topk_prob, capacity_factor=cfg.capacity_factor,
            shared_experts=cfg.shared_experts, shared_d_ff=cfg.d_expert, group_size=cfg.group_size)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # (aux, z) of the last forward: the model reads them after calling the block, so the block's
        # signature stays the Llama's (what the spec's blocks, checkpointing and ZeRO-3 units expect)
        self.losses: tuple[torch.Tensor, torch.Tensor] | None = None
        n_moe = cfg.n_layer - cfg.n_dense_layers
        # in a pipeline the block adds its weighted router losses to the running sum the stages pass on
        self.loss_weights = (cfg.aux_loss_coef / max(n_moe, 1), cfg.z_loss_coef / max(n_moe, 1))

    def forward(self, x, position_ids: torch.Tensor | None = None, documents: Documents | None = None):
        staged = isinstance(x, tuple)
        h, position_ids, *router = x if staged else (x, position_ids)
        h = h + self.self_attn(self.input_layernorm(h), position_ids, documents)
        out = self.mlp(self.post_attention_layernorm(h))
        if isinstance(out, MoEOutput):
            self.losses = (out.aux_loss, out.z_loss)
            if router:  # (h, positions, router loss so far): a pipeline stage
                router = [router[0] + self.loss_weights[0] * out.aux_loss + self.loss_weights[1] * out.z_loss]
            out = out.output
        h = h + out
        return (h, position_ids, *router) if staged else h


class LlamaMoEModel(nn.Module):
    def __init__(self, cfg: LlamaMoEConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaMoEDecoderLayer(cfg, i < cfg.n_dense_layers) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class LlamaMoE(nn.Module):
    """The Llama causal LM with MoE blocks; the loss it returns includes the weighted router losses."""

    def __init__(self, cfg: LlamaMoEConfig | str = "mixtral-tiny", **overrides):
        super().__init__()
        cfg = llama_moe_config(cfg, **overrides) if isinstance(cfg, str) else replace(cfg, **overrides)
        self.config = cfg
        self.model = LlamaMoEModel(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = TokenCrossEntropy()
        self.last_losses: dict[str, torch.Tensor] = {}  # detached device scalars: read them only to log
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, module in self.named_modules():
            init_moe_module(name, module)

    def _router_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        moe = [layer.losses for layer in self.model.layers if layer.losses is not None]
        aux = torch.stack([a for a, _ in moe]).mean()
        z = torch.stack([z for _, z in moe]).mean()
        self.last_losses = {"aux_loss": aux.detach(), "z_loss": z.detach()}
        return aux, z

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """idx (b, s) token ids -> the mean loss (+ router losses) if `targets` is given, else logits (b, s, V)."""
        check_token_ids(idx, self.model.embed_tokens.num_embeddings, "token ids")
        if targets is not None:
            check_token_ids(targets, self.config.vocab_size, "targets", ignore_index=-100)
        if position_ids is None:
            position_ids = torch.arange(idx.shape[1], device=idx.device)
        h = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            layer.losses = None
            h = layer(h, position_ids, documents)
        logits = self.lm_head(self.model.norm(h))
        if targets is None:
            return logits
        loss = self.loss_fn(logits, targets)
        if self.config.n_dense_layers < self.config.n_layer:
            aux, z = self._router_losses()
            loss = add_to_loss(loss, self.config.aux_loss_coef * aux + self.config.z_loss_coef * z)
        return loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def init_moe_module(name: str, module: nn.Module) -> None:
    """The Llama's init (N(0, 0.02) for Linear and Embedding, ones for norms), and N(0, 0.02) for the stacked
    experts, as transformers initializes Mixtral's per-expert Linears."""
    if isinstance(module, GroupedSwiGLU):
        for weight in (module.gate_proj, module.up_proj, module.down_proj):
            nn.init.normal_(weight, 0.0, 0.02)
    else:
        init_module(name, module)

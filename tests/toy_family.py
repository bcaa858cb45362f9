"""A throwaway model family, added through its model spec alone: everything paratrain needs to know about it is
in this file (tests/distributed/test_model_spec.py trains it in every layout). Its names match no built-in family's: the
blocks are `trunk.*`, attention is `mix` with `wq/wk/wv/wo`, the MLP is `ffn.up/down`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.model_spec import ModelSpec, register_model_spec
from paratrain.parallel.pp import PipelineModule

VOCAB, SEQ, WIDTH, HEADS, DEPTH = 256, 16, 32, 4, 4  # byte tokens: the embedded corpus


class ToyCore(nn.Module):
    """The family's own attention kernel, with paratrain's attention-core contract: (b, h, s, d) in and out."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))
        self.kernel = ToyCore()

    def forward(self, x):
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, -1, WIDTH // HEADS).transpose(1, 2)  # noqa: E731 (b, h_local, s, d)
        y = self.kernel(split(self.wq(x)), split(self.wk(x)), split(self.wv(x)))
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.mix, self.post = nn.LayerNorm(WIDTH), Mix(), nn.LayerNorm(WIDTH)
        self.ffn = nn.Sequential()
        self.ffn.up, self.ffn.act, self.ffn.down = nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.mix(self.pre(x))
        return x + self.ffn(self.post(x))


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.places = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)

    def forward(self, ids, position_ids=None):
        positions = torch.arange(ids.shape[1]) if position_ids is None else position_ids
        return self.tokens(ids) + self.places(positions)


class Readout(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, h):
        return self.proj(self.norm(h))


def toy_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Toy(nn.Module):
    def __init__(self, seed: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.trunk, self.out = Embedding(), nn.ModuleList(Layer() for _ in range(DEPTH)), Readout()

    def forward(self, ids, targets=None, position_ids=None):
        h = self.emb(ids, position_ids)
        for layer in self.trunk:
            h = layer(h)
        logits = self.out(h)
        return logits if targets is None else toy_loss(logits, targets)


@register_model_spec
class ToySpec(ModelSpec):
    name = "toy"

    def matches(self, model):
        return isinstance(model, Toy)

    def tp_plan(self, model):
        return {"trunk.*.mix": "region_input", "trunk.*.mix.w[qkv]": "colwise", "trunk.*.mix.kernel": "in_region",
                "trunk.*.mix.wo": "rowwise", "trunk.*.ffn.up": "colwise", "trunk.*.ffn.down": "rowwise"}

    def blocks(self, model):
        return list(model.trunk)

    def attention_cores(self, model):
        return [layer.mix.kernel for layer in model.trunk]

    def pipeline_module(self, model, micro_batch):
        return PipelineModule([model.emb, *model.trunk, model.out], loss_fn=toy_loss,
                              layer_names=["emb", *(f"trunk.{i}" for i in range(DEPTH)), "out"])

    def sequence_length(self, model):
        return SEQ


def toy_data(limit: int = 512):
    """(ids, targets) windows of the embedded corpus (byte tokens)."""
    from paratrain.data import TokenWindows, load_corpus

    train, _ = load_corpus()
    return TokenWindows(train[: limit * SEQ + 1], SEQ)

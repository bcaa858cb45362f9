"""Mixture of experts: the router and its losses (`router.py`), dispatch / combine
(`dispatch.py`), experts as stacked parameters computed by batched matmuls (`experts.py`), the layer
(`mixture.py`), its per-step routing metrics (`stats.py`), and DeepSpeed's `deepspeed.moe.layer.MoE`
(`layer.py`, with `deepspeed.moe.utils`' param groups in `utils.py`). A building block below the strategies,
like `paratrain.attention`; `exchange.py` holds the expert-parallel all-to-alls that `paratrain.parallel.ep.split`
sets up (docs/moe.md)."""

from paratrain.moe import layer, utils
from paratrain.moe.dispatch import DispatchPlan, combine, dispatch, expert_capacity, plan_dispatch
from paratrain.moe.experts import GroupedSwiGLU, StackedMLP, SwiGLU
from paratrain.moe.mixture import MoELayer, MoEOutput, MoEStats
from paratrain.moe.router import Router, Routing, load_balancing_loss, router_z_loss
from paratrain.moe.stats import LayerRouting, RoutingStep, collect_routing, reduce_routing, take_routing

__all__ = ["DispatchPlan", "GroupedSwiGLU", "LayerRouting", "MoELayer", "MoEOutput", "MoEStats", "Router", "Routing",
           "RoutingStep", "StackedMLP", "SwiGLU", "collect_routing", "combine", "dispatch", "expert_capacity", "layer",
           "load_balancing_loss", "plan_dispatch", "reduce_routing", "router_z_loss", "take_routing", "utils"]


def __getattr__(name: str):
    """deepspeed.moe.<name> that paratrain does not provide: an error naming it and the replacement."""
    from paratrain.compat.names import MOE, refuse

    refuse(MOE, "paratrain.moe (as deepspeed.moe)", name)

"""The hot path reads nothing back from the device: host reads per training step, counted in every layout.

`paratrain.testing.HostSyncs` patches every way Python reads a tensor's value (`item`, `tolist`, `cpu`,
`__float__`, `__bool__`, ..., and the functions that read inside torch: `torch.equal`, `allclose`, `nonzero`,
...), the CPU stand-in for CUDA's sync debug mode. After a first step (which checks batch agreement and agrees
on the token-loss unit), two more steps are counted with the monitor off and no log line due. Masked, padded
(left and right) and packed rows: no read of the device in DDP, ZeRO-1/2/3, tp/sp, pipelines, Ulysses,
recomputation and the engine-API loop; the layout of padded and packed rows (checks, documents' runs) is read
from the loader's tensors in host memory before they are copied to the device, counted apart and only in the
data path. What remains is named: ring attention reads which ring parts a row's documents leave empty, expert
parallelism and dropless capacity the row counts an all-to-all and a buffer need, and `nonfinite_loss: "stop"`
the norm once per step, before the update (the default, "stop_at_log", reads nothing: "engine api default").
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from unittest import mock

import torch
from torch.utils._pytree import tree_map_only

import paratrain
from paratrain.testing.host_syncs import HostSyncs
from tests.cases import adamw_config, corpus_windows, hf_param_groups, import_or_skip, tiny_gpt
from tests.distributed.test_expert_parallel import ep_config, moe_model
from tests.distributed.test_real_data import model_factory, real_layout
from tests.real_data import RealRows

LEAN = {"nonfinite_loss": "stop_at_log", "steps_per_print": 1000}
LAYOUTS = {"ddp": real_layout(1, 4), "zero1": real_layout(1, 4, zero=1), "zero2": real_layout(1, 4, zero=2),
           "zero3": real_layout(1, 4, zero=3), "zero2 offload": real_layout(1, 4, zero=2, offload=True),
           "dp2·tp2 sp": real_layout(2, 2, tp=2, sp=True), "dp2·pp2 1f1b": real_layout(2, 2, pp=2),
           "dp2·pp2 zb-v": real_layout(2, 2, pp=2, schedule="zb-v"), "dp2·cp2 ring": real_layout(2, 2, cp=2),
           "ulysses2": real_layout(2, 2, cp=2, cp_method="ulysses"),
           "dp2·pp2 full ckpt": real_layout(2, 2, pp=2, ckpt="full")}
RING_READS = ("parallel/cp/ring_masks.py",)  # which ring parts a row's documents leave empty (skipped)
HOST_READS = ("data/micro_batch.py", "data/token_layout.py", "attention.py")  # the loader's tensors: the layout
EXPERT_READS = ("moe/exchange.py", "moe/dispatch.py")  # ep all-to-all row counts; a dropless buffer's width


@contextlib.contextmanager
def _device_copies():
    """The engine's copies to the device make new tensors, which count as device memory: on a CPU the copy is the
    same tensor, so without this the stand-in could not tell the loader's tensors (host memory, free to read)
    from the ones the model runs on."""
    import paratrain.data.micro_batch as micro_batch

    def copy_(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        out.on_device = True
        return out

    def move(batch, device):
        return tree_map_only(torch.Tensor, copy_, batch)

    def move_micro_batch(self, device):
        return replace(self, **{k: copy_(v) for k, v in vars(self).items() if isinstance(v, torch.Tensor)},
                       documents=None if self.documents is None else self.documents.to(device))

    def on_host(*tensors):
        return all(t is None or (t.device.type == "cpu" and not getattr(t, "on_device", False)) for t in tensors)

    with mock.patch("paratrain.engine.forward_pass.to_device", move), \
            mock.patch.object(micro_batch.MicroBatch, "to", move_micro_batch), \
            mock.patch.object(micro_batch, "on_host", on_host):
        yield


def _counted(engine, data=None) -> dict[str, int]:
    engine.train_batch(data)
    with HostSyncs() as syncs:
        engine.train_batch(data)
        engine.train_batch(data)
    return {**syncs.sites, **{f"host: {site}": n for site, n in syncs.host_sites.items()}}


def _real(family: str, kind: str, cfg: dict, extra: dict = LEAN) -> dict[str, int]:
    model = model_factory(family)()
    engine, *_ = paratrain.initialize(model=model, config={**copy.deepcopy(cfg), **extra}, training_data=RealRows(kind),
                                      model_parameters=hf_param_groups(model))
    return _counted(engine)


def _engine_api(extra: dict) -> dict[str, int]:
    """forward / backward / step, the DeepSpeed loop, on the GPT family (2 micro-batches a step)."""
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, **extra)
    engine, _, loader, _ = paratrain.initialize(model=tiny_gpt(), config=cfg, training_data=corpus_windows())

    def step():
        for _ in range(2):
            x, y = next(loader)
            engine.backward(engine(x, y))
            engine.step()

    step()
    with HostSyncs() as syncs:
        step()
        step()
    return {**syncs.sites, **{f"host: {site}": n for site, n in syncs.host_sites.items()}}


def _moe(variant: str, ep: int) -> dict[str, int]:
    engine, *_ = paratrain.initialize(model=moe_model(variant), config={**ep_config(ep, 4), **LEAN},
                                      training_data=corpus_windows())
    return _counted(engine)


def _matrix() -> dict[str, dict[str, int]]:
    with _device_copies():
        return _cases()


def _cases() -> dict[str, dict[str, int]]:
    out = {f"masked {name}": _real("llama", "masked", cfg) for name, cfg in LAYOUTS.items()}
    out["masked bf16 zero1"] = _real("llama", "masked", LAYOUTS["zero1"], {**LEAN, "bf16": {"enabled": True}})
    for kind in ("packed", "left", "right"):
        for name in ("ddp", "zero3", "dp2·tp2 sp", "dp2·cp2 ring"):
            if kind != "right" or name in ("ddp", "zero3"):
                out[f"{kind} {name}"] = _real("llama", kind, LAYOUTS[name])
    out["engine api lean"] = _engine_api(LEAN)
    out["engine api stop"] = _engine_api({"nonfinite_loss": "stop"})
    out["engine api default"] = _engine_api({})  # the default configuration reads nothing per step
    out["moe dropping ep1"] = _moe("dropping", 1)
    out["moe dropping ep2"] = _moe("dropping", 2)
    out["moe dropless ep1"] = _moe("dropless", 1)
    return out


def _outside(sites: dict[str, int], allowed: tuple[str, ...]) -> dict[str, int]:
    return {site: n for site, n in sites.items() if not any(f"paratrain/{path}:" in site for path in allowed)}


def _split(sites: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(reads of the device, reads of host memory)."""
    host = {site.removeprefix("host: "): n for site, n in sites.items() if site.startswith("host: ")}
    return {site: n for site, n in sites.items() if not site.startswith("host: ")}, host


def test_training_steps_read_nothing_back(world4):
    import_or_skip("transformers")
    runs = world4.run(_matrix)
    for rank, per_case in enumerate(runs):
        for case, both in per_case.items():
            sites, host = _split(both)
            where = f"rank {rank}, {case}: {both}"
            assert _outside(host, HOST_READS) == {}, where  # only the data path reads host memory
            if case.startswith(("packed", "left", "right")):
                assert host, where  # their layout is read, from the loader's tensors
            if case.startswith(("packed", "left")) and case.endswith("ring"):
                assert sites and _outside(sites, RING_READS) == {}, where
                assert sum(sites.values()) <= 16 * 4, where  # 4 micro-batches a rank in 2 steps
            elif case == "engine api stop":  # one read of the norm per step, nothing else
                assert list(sites.values()) == [2] and "paratrain/engine/update.py:" in next(iter(sites)), where
            elif case.startswith("moe") and case != "moe dropping ep1":
                assert sites and _outside(sites, EXPERT_READS) == {}, where
            else:
                assert sites == {}, where

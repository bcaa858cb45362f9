"""Adapters out and back in, from sharded layouts: peft loads what paratrain saves, transformers loads the merged
model, and an adapter directory continues training in another layout.

A peft model trains 2 steps in dp2·tp2 ZeRO-3 SP (Llama, DoRA; and one DeepSpeed-style step, `engine(input_ids=,
labels=).loss`) and in pp2·tp2 (Qwen2, LoRA), then writes its adapter
(`engine.save_pretrained`) and the merged model (`merged=True`). In the test process: `PeftModel.from_pretrained`
of the adapter on the same base gives the logits of the trained model (its full state loaded into a fresh peft
model) within 1e-5, with the key set of peft's own save of that model and no empty tensor; transformers'
`from_pretrained` of the merged directory gives the same logits; rank 0 held at most twice the largest weight
(a tensor's pieces and the tensor assembled from them) and one layer's adapters, counted from outside (the tensor
storage alive at every operator). The adapter directory then goes into a plain transformers model through the `peft`
section (`peft.load`, dp4 ZeRO-1): its adapters start exactly where the saved ones were. Adapters on expert stacks
(paratrain's MoE, the `peft` section) save unmerged, and their merged save is refused by name.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.cases import LiveTensorBytes, import_or_skip, tiny_hf
from tests.distributed.test_real_data import real_layout
from tests.peft_cases import SECTIONS, peft_hf, section_model
from tests.real_data import RealRows

peft = import_or_skip("peft")

CASES = {"tp_zero3": ("llama", "dora", real_layout(2, 2, tp=2, sp=True, zero=3)),
         "pp_tp": ("qwen2", "lora", real_layout(2, 1, pp=2, tp=2))}


def _train_and_save(root: str) -> dict:
    from paratrain import initialize

    out = {}
    for name, (family, method, cfg) in CASES.items():
        engine, *_ = initialize(model=peft_hf(family, method), config=cfg, training_data=RealRows("masked"))
        for _ in range(2):
            engine.train_batch()
        if name == "tp_zero3":  # a DeepSpeed script's step: transformers' labels by keyword, .loss back
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
            for _ in range(cfg["gradient_accumulation_steps"]):
                output = engine(input_ids=ids, labels=ids)
                engine.backward(output.loss)
                engine.step()
            assert torch.isfinite(output.loss)
        engine.save_pretrained(f"{root}/{name}")
        with LiveTensorBytes() as live:  # what rank 0 allocates for the merged save, counted from outside
            engine.save_pretrained(f"{root}/{name}_merged", merged=True)
        state = engine.full_state_dict()
        out[name] = {"state": state if dist.get_rank() == 0 else None, "peak": live.peak}
    out["moe"] = _experts_save(root)
    cfg = {**real_layout(1, 4, zero=1), "peft": {"load": f"{root}/tp_zero3"}}
    engine, *_ = initialize(model=tiny_hf("llama"), config=cfg, training_data=RealRows("masked"))
    state = engine.full_state_dict()  # (collective)
    out["continued"] = state if dist.get_rank() == 0 else None
    return out


def _experts_save(root: str) -> str | None:
    """Adapters on expert stacks save unmerged; merging them is refused by name (what the refusal returns)."""
    from paratrain import initialize
    from paratrain.checkpoint import CheckpointError

    cfg = {**real_layout(1, 4), "peft": SECTIONS["moe experts"]}
    engine, *_ = initialize(model=section_model("moe experts"), config=cfg, training_data=RealRows("masked"))
    engine.train_batch()
    engine.save_pretrained(f"{root}/moe")
    try:
        engine.save_pretrained(f"{root}/moe_merged", merged=True)
    except CheckpointError as exc:
        return str(exc)
    return None


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_adapters_saved_from_sharded_layouts_load_with_peft_and_merged_with_transformers(world4, tmp_path):
    import transformers

    results = world4.run(_train_and_save, str(tmp_path))[0]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, (family, method, _) in CASES.items():
        trained = peft_hf(family, method)  # the in-memory model: the engine's full state in a fresh peft model
        missing, unexpected = trained.load_state_dict({f"base_model.model.{k}": v for k, v in
                                                       results[name]["state"].items()}, strict=False)
        assert not unexpected and not [k for k in missing if "lora" in k or "weight" in k], (missing, unexpected)
        want = _logits(trained, ids)
        loaded = peft.PeftModel.from_pretrained(tiny_hf(family), tmp_path / name)
        assert _rel(_logits(loaded, ids), want) <= 1e-5, name
        ours = load_file(tmp_path / name / "adapter_model.safetensors")
        trained.save_pretrained(tmp_path / f"{name}_peft")
        theirs = load_file(tmp_path / f"{name}_peft" / "adapter_model.safetensors")
        assert set(ours) == set(theirs) and all(t.numel() > 0 for t in ours.values()), name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["use_dora"] == (method == "dora") and config["r"] == 4, config
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_merged")
        assert _rel(_logits(merged, ids), want) <= 1e-5, name
        largest = max(p.numel() * 4 for p in trained.parameters())
        layers: dict[str, int] = {}
        for n, p in trained.named_parameters():
            if ".lora_" in n:
                layers[n.split(".lora_")[0]] = layers.get(n.split(".lora_")[0], 0) + p.numel() * 4
        layer = max(layers.values())
        # a tensor's pieces as they arrive and the tensor assembled from them, and one layer's adapters
        assert largest <= results[name]["peak"] <= 2 * largest + layer, (results[name]["peak"], largest, layer)
    # the expert stacks' adapters saved unmerged (a merged save refused, naming the fix)
    assert results["moe"].startswith("save_pretrained(merged=True) with adapters on expert stacks"), results["moe"]
    assert any("experts" in k for k in load_file(tmp_path / "moe" / "adapter_model.safetensors"))
    assert not (tmp_path / "moe_merged").exists()
    saved = results["tp_zero3"]["state"]
    continued = results["continued"]
    adapters = [k for k in saved if "lora_" in k]
    assert adapters and all(torch.equal(continued[k], saved[k]) for k in adapters)

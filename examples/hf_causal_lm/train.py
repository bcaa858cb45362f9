"""Fine-tune a Hugging Face causal LM directory on a text file, in any layout, with no plan written.

    paratrain run --nproc-per-node 2 examples/hf_causal_lm/train.py                      # a random tiny Llama
    paratrain run --nproc-per-node 4 examples/hf_causal_lm/train.py --model-dir my-model --layout '{"pipeline":
        {"stages": 2}, "zero_optimization": {"stage": 1}}'
    paratrain report runs/hf_causal_lm                                                    # memory, loss curve

With no --model-dir it writes a small random-weight Llama (transformers' `save_pretrained`) to
runs/hf_causal_lm_model and says so. The text is the embedded corpus unless --text is given, tokenized by the
directory's tokenizer (bytes without one). The run is `paratrain train` on that directory
(`trainer.model`): weights loaded slice by slice, metrics.jsonl for `paratrain report`, and with
--save-pretrained the trained model written back as a directory transformers loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

import paratrain
from paratrain.trainer import train

HERE = Path(__file__).parent
TINY_LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def make_random_model(directory: Path) -> None:
    """A byte-level Llama with random weights (rank 0 writes it; the others wait)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
        model.save_pretrained(directory)
        print(f"no --model-dir given: wrote a random-weight Llama ({sum(p.numel() for p in model.parameters()):,} "
              f"parameters, byte vocabulary) to {directory}")
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--config", default=str(HERE / "config.json"), help="paratrain/DeepSpeed JSON config")
    parser.add_argument("--layout", default=None, help="JSON merged over the config (e.g. a different layout)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--save-pretrained", default=None, help="write the trained model here")
    args = parser.parse_args()
    paratrain.init_distributed()
    config = json.loads(Path(args.config).read_text())
    config.update(json.loads(args.layout) if args.layout else {})
    model_dir = Path(args.model_dir) if args.model_dir else Path("runs/hf_causal_lm_model")
    if args.model_dir is None and not (model_dir / "config.json").is_file():
        make_random_model(model_dir)
    config["trainer"] = {**config.get("trainer", {}), "model": str(model_dir)}
    summary = train(config, steps=args.steps, save_pretrained=args.save_pretrained)
    if dist.get_rank() == 0:
        print(json.dumps({k: summary[k] for k in ("first_loss", "last_loss", "val_loss", "layout", "params")}))


if __name__ == "__main__":
    main()

"""Write what the fine-tuning example needs, from the embedded corpus only (there is no hub here):

    python examples/sft/make_data.py                 # -> runs/sft/{train,validation}.jsonl and runs/sft/model/

- an instruction dataset: for each section of Python's documentation (the embedded corpus), a conversation
  per paragraph: a system prompt, the user's question about the section's title, the paragraph as the
  assistant's answer (`{"messages": [...]}` per line, the `chat` format); every tenth section validates;
- a tokenizer: byte-level BPE of 1,024 ids trained on the corpus with the `tokenizers` library, with a ChatML
  chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`), saved as a transformers tokenizer;
- a model directory: a random-weight Llama (transformers' LlamaForCausalLM, 4 layers, width 128, grouped-
  query attention) with that tokenizer, as `save_pretrained` writes it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SYSTEM = "You answer questions about the Python language from its reference documentation."
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|pad|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]


def sections() -> list[tuple[str, list[str]]]:
    """(title, paragraphs) of each documentation topic, in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        lines = topics[key].strip().splitlines()
        title = lines[0].strip()
        body = "\n".join(line for line in lines[1:] if not re.fullmatch(r"[*=\-^\"]+", line.strip()))
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body) if len(p.split()) >= 8]
        if paragraphs:
            out.append((title, paragraphs))
    return out


def conversations() -> tuple[list[dict], list[dict]]:
    train, validation = [], []
    for number, (title, paragraphs) in enumerate(sections()):
        for part, paragraph in enumerate(paragraphs[:6], 1):
            question = f"What does the reference say about {title}?" if part == 1 else \
                f"Tell me more about {title} (part {part})."
            record = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                                   {"role": "assistant", "content": paragraph[:600]}]}
            (validation if number % 10 == 9 else train).append(record)
    return train, validation


def write_tokenizer(directory: Path, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|eos|>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def write_model(directory: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(str(directory))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/sft"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    train, validation = conversations()
    for name, records in (("train", train), ("validation", validation)):
        with (args.out / f"{name}.jsonl").open("w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
    texts = [m["content"] for r in train for m in r["messages"]]
    tokenizer = write_tokenizer(args.out / "model", texts)
    write_model(args.out / "model", len(tokenizer))
    print(f"{len(train)} training and {len(validation)} validation conversations, a tokenizer of "
          f"{len(tokenizer)} ids and a random Llama in {args.out}")


if __name__ == "__main__":
    main()

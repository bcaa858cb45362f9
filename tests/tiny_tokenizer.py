"""A tiny real tokenizer for the data tests: byte-level BPE trained in memory, saved as a transformers tokenizer.

    save_tiny_tokenizer(tmp_path)        # tokenizer.json, tokenizer_config.json, its chat template
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)

The tests need what a downloaded model's tokenizer gives (merges that span several characters, special tokens,
offsets, a Jinja chat template) without the hub: this builds one from a few hundred words in well under a
second. Byte-level pre-tokenization makes `decode(encode(text)) == text` for any text, so a test can decode the
trained tokens and compare them with the exact characters it expects. The chat template is ChatML's shape
(`<|im_start|>role\\ncontent<|im_end|>\\n` per message), the one Qwen and many fine-tunes use.
"""

from __future__ import annotations

from pathlib import Path

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough repeated English, chat words and punctuation that BPE learns multi-character merges (" the",
# "assistant", "Paris"), so tokens really do cross word and role boundaries unless the text stops them.
_WORDS = """
The capital of France is Paris. The capital of Italy is Rome. What is the capital of Spain? It is Madrid.
You are a helpful assistant. The user asks a question and the assistant answers it with care.
system user assistant tool question answer prompt completion hello world the a of to is in and it that
Translate to French: good morning. Bonjour. How many legs has a spider? Eight. Two plus two is four.
A paragraph is a group of sentences about one idea. A line ends where the newline is.
"""


def training_text() -> list[str]:
    return [line.strip() for line in _WORDS.strip().splitlines()] * 4 + ["system user assistant"] * 8


def build_tiny_tokenizer(vocab_size: int = 400):
    """A `transformers.PreTrainedTokenizerFast` (byte-level BPE, bos/eos/pad, the ChatML-like template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD, TURN_START, TURN_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(training_text(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        additional_special_tokens=[TURN_START, TURN_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_tokenizer(directory: str | Path, vocab_size: int = 400):
    """Build the tiny tokenizer and `save_pretrained` it into `directory`; returns the tokenizer."""
    tokenizer = build_tiny_tokenizer(vocab_size)
    tokenizer.save_pretrained(str(directory))
    return tokenizer

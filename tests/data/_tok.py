"""A tiny byte-level BPE tokenizer with a ChatML template, built offline for the data tests."""
from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Breaks the prefix property: the trailer appears only after the last message, so a rendering of a
# prefix of the conversation is not a prefix of the full rendering.
CHATML_WITH_TRAILER = CHATML + "{% if not add_generation_prompt %}{{ '<|endoftext|>' }}{% endif %}"

_CORPUS = [
    "Hello there! How are you today?",
    "I am fine, thank you. What can I do for you?",
    "Tell me a story about a cat and a dog.",
    "Once upon a time, a cat and a dog lived in a small house.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "You are a helpful assistant. Answer briefly.",
    "system user assistant",
] * 4


@functools.lru_cache(maxsize=None)
def _trained() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok.to_str()


def build_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """Fresh tokenizer (cheap: the trained model is cached as JSON)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained()),
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok

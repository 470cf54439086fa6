"""The demo tokenizer: a byte-level BPE trained on the demo chat set, saved as a
PreTrainedTokenizerFast with the ChatML template (bit-identical on every rebuild)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from specjax.demo.tasks import CHAT_TEMPLATE, EOT, IM_END, IM_START, SPECIAL_TOKENS


def demo_tokenizer_texts(rows: Iterable[dict]) -> list[str]:
    """Training text for the BPE: each message as its template renders it, minus the special
    tokens (those are added whole and never merged)."""
    return [f"{m['role']}\n{m['content']}" for r in rows for m in r["messages"]]


def build_demo_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512):
    """Train a byte-level BPE (digits split one per token, which makes arithmetic far easier for
    a tiny model), wrap it as a PreTrainedTokenizerFast with ChatML and save it to `out_dir`.
    Returns the transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Own split rule: words / punctuation runs keep their leading space (GPT-2 style), but every
    # digit is its own piece (" 94" -> " 9", "4") so numbers never merge into opaque chunks.
    split = Regex(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x exactly
        model_max_length=2048,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    save_tokenizer_portable(hf_tok, out_dir)
    return hf_tok


def save_tokenizer_portable(tokenizer, out_dir: str | os.PathLike) -> None:
    """save_pretrained, then rewrite tokenizer_config.json in the spelling that both transformers
    5 and 4.x read (serving stacks often pin 4.x): class PreTrainedTokenizerFast, a list under
    additional_special_tokens (4.x breaks on a list-valued extra_special_tokens) and the chat
    template inline as well as in chat_template.jinja."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    path = out_dir / "tokenizer_config.json"
    conf = json.loads(path.read_text())
    for k in ("is_local", "local_files_only"):  # load-time flags, not properties of the tokenizer
        conf.pop(k, None)
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = conf.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        conf["additional_special_tokens"] = extra
    elif extra:
        conf["extra_special_tokens"] = extra
    conf["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")

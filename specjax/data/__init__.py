"""Data: read chat files, template + tokenize with assistant loss masks, pack into static batches."""
from specjax.data.chat import Example, SkipRow, resolve_chat_template, tokenize_conversation
from specjax.data.pipeline import (
    Prepared,
    make_eval_batches,
    make_train_iterator,
    prepare_examples,
    split_is_val,
)
from specjax.data.datasets import read_conversations
from specjax.data.sources import Row, RowError

__all__ = [
    "Example",
    "Prepared",
    "Row",
    "RowError",
    "SkipRow",
    "make_eval_batches",
    "make_train_iterator",
    "prepare_examples",
    "read_conversations",
    "resolve_chat_template",
    "split_is_val",
    "tokenize_conversation",
]

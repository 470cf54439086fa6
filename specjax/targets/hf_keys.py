"""Tables of HF config.json keys: one row per key a target config reads (key, field, converter,
default), so that a family's ``from_hf`` reads and its ``to_hf`` writes the same keys from one table.

``ATTENTION_KEYS`` are the keys every attention-stack family (Llama, Qwen3, Qwen3-MoE, HRM-Text)
shares; a family adds its own rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

REQUIRED = object()  # a row without a default: the key must be in config.json


@dataclasses.dataclass(frozen=True)
class HFKey:
    """config.json ``key`` -> config field ``field`` (same name unless given), through ``convert``.
    ``default``: the value when the key is absent or null; a callable gets the whole HF dict.
    (``field`` lets a row name a config field other than its key.)"""

    key: str
    convert: Callable[[Any], Any] = int
    default: Any = REQUIRED
    field: str = ""
    zero_is_absent: bool = False  # 0 also takes the default (num_key_value_heads, head_dim)

    @property
    def field_name(self) -> str:
        return self.field or self.key


def read_hf_keys(table: Sequence[HFKey], hf: Mapping[str, Any]) -> dict[str, Any]:
    """{field: value} for every row of ``table`` from the HF config dict ``hf``."""
    out = {}
    for row in table:
        value = hf.get(row.key)
        if value is None or (row.zero_is_absent and not value):
            if row.default is REQUIRED:
                value = hf[row.key]  # KeyError naming the key, as a plain lookup would
            value = row.default(hf) if callable(row.default) else row.default
        out[row.field_name] = row.convert(value)
    return out


def hf_values(table: Sequence[HFKey], config: Any) -> dict[str, Any]:
    """{config.json key: value} of ``config``'s fields for every row of ``table`` (the inverse of
    :func:`read_hf_keys`)."""
    return {row.key: getattr(config, row.field_name) for row in table}


def _heads(hf):
    return hf["num_attention_heads"]


def _head_dim(hf):
    return int(hf["hidden_size"]) // int(hf["num_attention_heads"])


def attention_keys(max_position_embeddings: int) -> tuple[HFKey, ...]:
    """The shared rows, with the family's default context length."""
    return (
        HFKey("vocab_size"),
        HFKey("hidden_size"),
        HFKey("intermediate_size"),
        HFKey("num_attention_heads"),
        HFKey("num_key_value_heads", default=_heads, zero_is_absent=True),
        HFKey("head_dim", default=_head_dim, zero_is_absent=True),
        HFKey("rms_norm_eps", float, 1e-6),
        HFKey("tie_word_embeddings", bool, False),
        HFKey("max_position_embeddings", int, max_position_embeddings),
    )


def check_gqa(cfg: Any) -> None:
    """ValueError unless the query heads split evenly over the KV heads."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )

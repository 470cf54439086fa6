"""Sanity checks of a model's config.json fields, shared by every reader of a target or a draft head
config (standard library only, so the jax-free head readers in specjax_converters use it too).

`read_config_json(path)` reads a JSON object from a file of bounded size (`MAX_CONFIG_BYTES`); a
file that is not JSON, nests too deep, or holds a list instead of an object fails with one line
naming the file. `check_name_inside` refuses a file name that a manifest or a shard index lists
unless it is a relative path inside the model folder ("../../etc/passwd" and "/dev/zero" are never
opened). `check_config_fields(config, where)` then checks the fields that size arrays or
enter the arithmetic of a forward, wherever they are present (top level and the nested
`text_config`, `transformer_layer_config`, `dflash_config`, `eagle_config` blocks, and every RoPE
dict), before anything is allocated from them:

* sizes (`INT_FIELDS`) are JSON integers (not true/false, 4096.0, "4096", null or Infinity) within
  generous bounds: hidden 2^17, intermediate 2^20, vocab 2^24, heads 4096, head_dim 8192, layers
  4096, experts 16384, context 2^27, and layers x experts <= 2^20, layers x loops <= 2^16. The
  largest published models (DeepSeek-V3 / Kimi K2: hidden 7168, intermediate 18432, 61 layers,
  256 / 384 experts, vocab 163840, 128 / 64 heads; Llama-3.1-405B: hidden 16384, 126 layers) are
  an order of magnitude or more inside them;
* norm epsilons are finite and in (0, 1); rope_theta and RoPE scaling factors finite and > 0;
  partial_rotary_factor in (0, 1]; every other number in a RoPE dict finite;
* layer id lists (aux taps, dflash target_layer_ids, mlp_only_layers) are lists of integers.

The first bad field raises ConfigFieldError (a ValueError):
`<where>: <field>: <value> <problem>. Fix: <fix>`, where `where` is the file (or what the dict
is) and the value is spelled as JSON (Infinity, NaN, null, "abc").
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional

__all__ = ["ConfigFieldError", "FLOAT_FIELDS", "INT_FIELDS", "MAX_CONFIG_BYTES", "check_config_fields",
           "check_name_inside", "read_config_json"]

# A real config.json is a few KiB (a few hundred with an id2label table); an index of a sharded
# checkpoint a few MiB. Reading is refused above this, before json builds anything from it.
MAX_CONFIG_BYTES = 64 << 20

# name -> (lowest, highest, null allowed). null is allowed where engines treat it as "absent, use
# the default"; the fields every reader needs (hidden_size, heads, layers, vocab, ...) must be numbers.
INT_FIELDS: dict[str, tuple[int, int, bool]] = {
    "hidden_size": (1, 1 << 17, False),
    "target_hidden_size": (1, 1 << 17, True),
    "intermediate_size": (1, 1 << 20, False),
    "moe_intermediate_size": (1, 1 << 20, True),
    "shared_expert_intermediate_size": (0, 1 << 20, True),
    "moe_shared_expert_intermediate_size": (0, 1 << 20, True),
    "vocab_size": (1, 1 << 24, False),
    "draft_vocab_size": (1, 1 << 24, True),
    "num_attention_heads": (1, 4096, False),
    "num_key_value_heads": (1, 4096, True),
    "head_dim": (1, 8192, True),
    "num_hidden_layers": (1, 4096, False),
    "num_target_layers": (1, 4096, True),
    "num_experts": (1, 16384, True),
    "num_local_experts": (1, 16384, True),
    "n_routed_experts": (1, 16384, True),
    "n_shared_experts": (0, 16384, True),
    "num_experts_per_tok": (1, 16384, True),
    "decoder_sparse_step": (1, 4096, True),
    "max_position_embeddings": (1, 1 << 27, True),
    "num_aux_hidden_states": (1, 1024, True),
    "num_loops": (0, 1024, True),  # 0: targets.looped's own rule says "must be >= 1"
    "loop_start": (0, 4096, True),
    "loop_end": (0, 4096, True),
    "num_layers_per_stack": (1, 4096, True),
    "H_cycles": (1, 1024, True),
    "L_cycles": (1, 1024, True),
    "block_size": (1, 4096, True),
    "mamba_num_heads": (1, 1 << 16, True),
    "mamba_head_dim": (1, 8192, True),
    "n_groups": (1, 4096, True),
    "ssm_state_size": (1, 1 << 16, True),
    "conv_kernel": (1, 1024, True),
    "chunk_size": (1, 1 << 20, True),
    # multi-head latent attention and grouped routing (DeepSeek-V3 / Kimi K2)
    "q_lora_rank": (1, 1 << 17, True),
    "kv_lora_rank": (1, 1 << 17, True),
    "qk_nope_head_dim": (1, 8192, True),
    "qk_rope_head_dim": (1, 8192, True),
    "v_head_dim": (1, 8192, True),
    "n_group": (1, 16384, True),
    "topk_group": (1, 16384, True),
    "first_k_dense_replace": (0, 4096, True),
    "num_nextn_predict_layers": (0, 64, True),
    # sliding windows (Mistral, Phi-3, Gemma 3, gpt-oss)
    "sliding_window": (1, 1 << 27, True),
    "sliding_window_pattern": (1, 4096, True),
    "query_pre_attn_scalar": (1, 1 << 20, True),
}
# products of the fields above that size per-layer tables (one name per layer and expert, one
# cache row per virtual layer): each factor may be generous, their product must stay bounded
_PRODUCT_LIMITS = (
    (("num_hidden_layers", ("num_experts", "num_local_experts", "n_routed_experts")), 1 << 20),
    (("num_hidden_layers", ("num_loops",)), 1 << 16),
)
# name -> (lowest, highest, lowest excluded, highest excluded); null only for _FLOATS_NULL_OK
FLOAT_FIELDS: dict[str, tuple[float, float, bool, bool]] = {
    "rms_norm_eps": (0.0, 1.0, True, True),
    "layer_norm_eps": (0.0, 1.0, True, True),
    "layer_norm_epsilon": (0.0, 1.0, True, True),
    "norm_eps": (0.0, 1.0, True, True),
    "rope_theta": (0.0, math.inf, True, True),
    "partial_rotary_factor": (0.0, 1.0, True, False),
    "initializer_range": (0.0, math.inf, True, True),
    "routed_scaling_factor": (-math.inf, math.inf, True, True),
    "embedding_scale": (-math.inf, math.inf, True, True),
}
_FLOATS_NULL_OK = ("embedding_scale",)  # HRM-Text: null = 1 / initializer_range
# inside a RoPE dict (rope_scaling / rope_parameters, or one of rope_parameters' per-layer-type dicts)
_ROPE_FLOATS: dict[str, tuple[float, float, bool, bool]] = {
    "rope_theta": FLOAT_FIELDS["rope_theta"],
    "factor": (0.0, math.inf, True, True),
    "partial_rotary_factor": FLOAT_FIELDS["partial_rotary_factor"],
}
_ROPE_KEYS = ("rope_scaling", "rope_parameters")
_NESTED = ("text_config", "transformer_layer_config", "dflash_config", "eagle_config")
_ID_LISTS = ("eagle_aux_hidden_state_layer_ids", "target_layer_ids", "mlp_only_layers")
_MAX_IDS, _MAX_ID = 4096, 1 << 16


class ConfigFieldError(ValueError):
    """A config field that is the wrong type or outside its sanity bounds; the message names the
    file (`where`) and the field."""

    def __init__(self, where: str, field: str, problem: str, fix: str):
        super().__init__(f"{where}: {field}: {problem}. Fix: {fix}")
        self.where = where
        self.field = field


def _spell(value: Any, limit: int = 60) -> str:
    """`value` as JSON spells it (Infinity, NaN, null, true, "abc"), cut to `limit` characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _not_a(value: Any, what: str) -> str:
    """'<value> is not <what>', saying which JSON type it is where the spelling alone does not."""
    kind = {str: "a string", bool: "a boolean", list: "a list", dict: "an object"}.get(type(value))
    return f"{_spell(value)} is {kind}, not {what}" if kind else f"{_spell(value)} is not {what}"


def _num(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"


def read_config_json(path: str, what: str = "config", max_bytes: int = MAX_CONFIG_BYTES,
                     fix: Optional[str] = None) -> dict:
    """The JSON object in the file `path`, read only when the file is at most `max_bytes`; a file
    that is larger, not UTF-8 JSON, nested too deep, or not an object raises ConfigFieldError
    naming `path` (`what` says what the file should be; `fix` replaces the default advice, to use
    the model's original file)."""
    fix = fix or f"use the model's original {os.path.basename(path)}"
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ConfigFieldError(path, "(file)", f"{size} bytes, more than the {max_bytes} a {what} file can "
                               "reasonably have", fix)
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except RecursionError:
        raise ConfigFieldError(path, "(file)", "JSON nested too deep to read",
                               fix) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an integer over Python's digit limit
        raise ConfigFieldError(path, "(file)", f"not valid JSON ({e})",
                               fix) from None
    if not isinstance(value, dict):
        raise ConfigFieldError(path, "(file)", f"a JSON {type(value).__name__}, not an object of {what} fields",
                               fix)
    return value


def check_name_inside(folder: str, name: Any, listed_in: str, field: str) -> str:
    """`folder`/`name` for a file name that `listed_in` (a manifest or a shard index) gives in `field`;
    ValueError naming both unless `name` is a relative path inside `folder` (not absolute, no ".."
    or empty parts). Only the spelling is checked: a model in the Hugging Face cache is a folder of
    symlinks into its blob store, and those are the model's own files."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else []
    if not parts or os.path.isabs(name) or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{listed_in}: {field}: {_spell(name, 400)} is not a file inside {folder} (only names relative "
                         "to the folder are read). Fix: export or download the folder again")
    return os.path.join(folder, name)


def _check_int(where: str, field: str, value: Any, lo: int, hi: int, null_ok: bool) -> None:
    if value is None and null_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigFieldError(where, field, _not_a(value, "an integer"),
                               f"write {field} as a whole number from {lo} to {hi} (the model's real value)")
    if not lo <= value <= hi:
        raise ConfigFieldError(where, field, f"{_spell(value)} is outside [{lo}, {hi}] (a sanity bound well "
                               "beyond any published model)", f"write the model's real {field}")


def _check_float(where: str, field: str, value: Any, bounds: tuple[float, float, bool, bool]) -> None:
    lo, hi, lo_open, hi_open = bounds
    rng = f"{'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigFieldError(where, field, _not_a(value, "a number"),
                               f"write {field} as a finite number in {rng} (the model's real value)")
    ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and (value < hi if hi_open else value <= hi)
    if not ok:
        raise ConfigFieldError(where, field, f"{_spell(value)} is not a finite number in {rng}",
                               f"write the model's real {field}")


def _check_rope(where: str, field: str, rope: Any) -> None:
    if rope is None:
        return
    if not isinstance(rope, Mapping):
        raise ConfigFieldError(where, field, _not_a(rope, "an object"),
                               f"write {field} as an object (rope_type, rope_theta, ...) or leave it out")
    if rope and all(isinstance(v, Mapping) for v in rope.values()):  # per layer type (hybrid sliding configs)
        for kind, sub in rope.items():
            _check_rope(where, f"{field}.{kind}", sub)
        return
    for key, value in rope.items():
        name = f"{field}.{key}"
        if key in _ROPE_FLOATS:
            _check_float(where, name, value, _ROPE_FLOATS[key])
        elif key == "original_max_position_embeddings":
            _check_int(where, name, value, 1, INT_FIELDS["max_position_embeddings"][1], True)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigFieldError(where, name, f"{_spell(value)} is not a finite number",
                                   f"write the model's real {key}")
        elif isinstance(value, list):
            for i, x in enumerate(value[:_MAX_IDS + 1]):
                if isinstance(x, float) and not math.isfinite(x):
                    raise ConfigFieldError(where, f"{name}[{i}]", f"{_spell(x)} is not a finite number",
                                           f"write the model's real {key}")


def _check_ids(where: str, field: str, ids: Any) -> None:
    if ids is None:
        return
    if not isinstance(ids, list) or len(ids) > _MAX_IDS:
        raise ConfigFieldError(where, field, _not_a(ids, f"a list of at most {_MAX_IDS} layer ids"),
                               f"write {field} as a list of layer numbers")
    for i, x in enumerate(ids):
        _check_int(where, f"{field}[{i}]", x, -1, _MAX_ID, False)


def check_config_fields(config: Mapping, where: str, prefix: str = "") -> None:
    """Raise ConfigFieldError for the first field of `config` (a config.json dict) that is the wrong
    type or out of bounds (see the module docstring). `where` names the file in the message;
    `prefix` is the path of a nested block ("text_config.")."""
    if not isinstance(config, Mapping):
        raise ConfigFieldError(where, prefix.rstrip(".") or "(config)", _not_a(config, "an object of config fields"),
                               "use the model's original config.json")
    for field, (lo, hi, null_ok) in INT_FIELDS.items():
        if field in config:
            _check_int(where, prefix + field, config[field], lo, hi, null_ok)
    for field, bounds in FLOAT_FIELDS.items():
        if field in config and not (config[field] is None and field in _FLOATS_NULL_OK):
            _check_float(where, prefix + field, config[field], bounds)
    for field in _ROPE_KEYS:
        if field in config:
            _check_rope(where, prefix + field, config[field])
    for field in _ID_LISTS:
        if field in config:
            _check_ids(where, prefix + field, config[field])
    for (first, others), limit in _PRODUCT_LIMITS:
        a = config.get(first)
        b_name = next((n for n in others if isinstance(config.get(n), int)), None)
        if isinstance(a, int) and b_name is not None and a * config[b_name] > limit:
            raise ConfigFieldError(where, prefix + b_name, f"{first} x {b_name} = {a} x {config[b_name]} is over "
                                   f"{limit} (a sanity bound well beyond any published model)",
                                   f"write the model's real {first} and {b_name}")
    for block in _NESTED:
        sub: Optional[Any] = config.get(block)
        if sub is not None:
            check_config_fields(sub, where, f"{prefix}{block}.")

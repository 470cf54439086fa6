"""Facts about a target model, read from its config.json dict: the language-model part of a
multimodal config, the decoder depth aux ids address (looped targets count the unrolled depth),
whether it is a Mamba/attention hybrid, and its RoPE in one normalised form.

The default aux taps engines use for a head without aux ids are
specjax.aux_ids.default_aux_layer_ids(target_virtual_depth(config), clamp=False).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

__all__ = ["is_hybrid_target", "rope_dict", "target_rope_dicts", "target_text_config", "target_virtual_depth"]

# config keys that mean "this target mixes Mamba/SSM or linear-attention blocks with attention"
_HYBRID_KEYS = ("hybrid_override_pattern", "layers_block_type", "mamba_num_heads", "mamba_head_dim",
                "ssm_state_size", "mamba_d_ssm", "linear_num_value_heads", "linear_attn_config")
_HYBRID_MODEL_TYPES = ("nemotron_h", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid",
                       "qwen3_next", "lfm2", "plamo2", "kimi_linear")


def target_text_config(target_config: Mapping) -> dict:
    """The language-model part of a target config (multimodal configs nest it as text_config)."""
    tc = target_config.get("text_config")
    return dict(tc) if isinstance(tc, Mapping) else dict(target_config)


def target_virtual_depth(target_config: Mapping) -> int:
    """Decoder steps per token. For a looped (weight-shared) target whose span [loop_start, loop_end)
    runs num_loops times (specjax.targets.looped; the Nanbeige card: 22 layers x 2 loops = 44):
    L + (num_loops - 1) * (loop_end - loop_start); otherwise num_hidden_layers."""
    tc = target_text_config(target_config)
    if "num_hidden_layers" in tc:
        L = int(tc["num_hidden_layers"])
    else:  # hybrids saved by transformers 5 describe their depth by the block pattern only
        pattern = tc.get("layers_block_type") or tc.get("hybrid_override_pattern")
        if not pattern:
            raise ValueError("target config has neither num_hidden_layers nor a block pattern "
                             "(layers_block_type / hybrid_override_pattern); cannot tell its depth")
        L = len(pattern)
    loops = max(int(tc.get("num_loops") or 1), 1)
    start = int(tc.get("loop_start") or 0)
    end = L if tc.get("loop_end") is None else int(tc["loop_end"])
    return L + (loops - 1) * (end - start)


def is_hybrid_target(target_config: Mapping) -> bool:
    tc = target_text_config(target_config)
    mt = str(tc.get("model_type", "")).lower()
    if mt in _HYBRID_MODEL_TYPES or any(k in tc for k in _HYBRID_KEYS):
        return True
    types = tc.get("layer_types") or []
    return any(isinstance(t, str) and ("mamba" in t or "linear" in t or "ssm" in t) for t in types)


def target_rope_dicts(config: Mapping) -> list[dict]:
    """Every RoPE a draft of this target may copy, as rope_dict forms: one per layer type when
    rope_parameters is nested per layer type (Gemma 3 / 4: the sliding layers' and the full layers';
    a draft copies the one it can represent: Gemma 4's full layers use a "proportional" RoPE that the
    engines' Llama drafts do not), else the config's one RoPE ([] when it names none)."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        rest = {k: v for k, v in config.items() if k != "rope_parameters"}
        return [rope_dict({**rest, "rope_parameters": p}) for _, p in sorted(params.items())]
    one = rope_dict(config)
    return [] if one is None else [one]


def rope_dict(config: Mapping) -> Optional[dict]:
    """A config's RoPE as one normalised dict {rope_type, rope_theta, <scaling keys>} from either
    layout (transformers 5 `rope_parameters`, or `rope_theta` + `rope_scaling`); None when the config
    has neither key."""
    if "rope_parameters" not in config and "rope_theta" not in config and "rope_scaling" not in config:
        return None
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        # per-layer-type rope (Gemma 3, gpt-oss-style hybrids): the full-attention layers' RoPE is the
        # one a draft copies; without that entry, compare the legacy keys
        params = params.get("full_attention")
    if not isinstance(params, Mapping):
        params = dict(config.get("rope_scaling") or {})
    params = dict(params)
    # M-RoPE's sections (Qwen3.5's multimodal configs) rotate text positions as plain RoPE: the three
    # position streams of a text token are equal
    # Mistral 4's llama_4_scaling_beta rides in rope_parameters but scales the target's queries by
    # position; it is not part of the rotation a draft copies
    out = {k: v for k, v in params.items()
           if k not in ("type", "rope_type", "rope_theta", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta")}
    out["rope_type"] = params.get("rope_type", params.get("type", "default"))
    out["rope_theta"] = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    # partial rotary: inside rope_parameters (transformers 5) or top-level (the legacy layout, which
    # vLLM's Llama attention reads); a factor of 1 is full rotary either way
    factor = out.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None and config.get("rotary_dim"):  # MiniMax-M2's legacy key: rotated dims of each head
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        factor = int(config["rotary_dim"]) / int(head_dim)
    out.pop("partial_rotary_factor", None)
    if factor is not None and float(factor) != 1.0:
        out["partial_rotary_factor"] = float(factor)
    if out["rope_type"] == "llama3" and "original_max_position_embeddings" not in out:
        out["original_max_position_embeddings"] = config.get("max_position_embeddings")
    if out["rope_type"] == "longrope" and out.get("attention_factor") is None:
        # the default transformers (and vLLM) derive when config.json names none, so a config that
        # spells it out and one that leaves it to the reader compare equal
        orig = out.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        longest = config.get("max_position_embeddings")
        if orig and longest:
            scale = float(longest) / float(orig)
            out["attention_factor"] = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    return out


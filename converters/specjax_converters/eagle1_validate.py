"""The rules of an EAGLE-1 head folder (draft.type eagle): what vLLM 0.32's `"method": "eagle"`
loader (vllm/model_executor/models/llama_eagle.py, EagleLlamaForCausalLM) needs, and what specjax
reads back.

config.json: architectures ["EagleLlamaForCausalLM"] (`is_eagle1_config`), model_type "llama",
num_hidden_layers 1, the decoder shape keys (hidden_size, heads, head_dim, intermediate_size), the
target's vocab_size, no reduced draft vocab.
Weights (specjax.drafts.eagle1_weights.EAGLE1_WEIGHTS): fc.weight [H, 2H] and layers.0.{self_attn.
{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, one float dtype. Refused:
a `model.` prefix (vLLM adds it), fc.bias (vLLM's fc has none), layers.0.input_layernorm.weight (vLLM
replaces that norm by the identity), norm / lm_head (the class has neither: the target's lm_head reads
the layer's output), d2t / t2d (no draft vocab). A shipped embed_tokens.weight is a warning (vLLM
keeps it when it differs from the target's; specjax trains and decodes with the target's).
Against the target: hidden_size, vocab_size and RoPE equal.

No jax at import: numpy, the weight table, head_files, head_rules and target_facts.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from specjax.drafts import weights
from specjax.drafts.eagle1_weights import ARCHITECTURE, EAGLE1_WEIGHTS
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import HeadFormat, check_embedding_copy, check_weight_dtypes, same_value
from specjax_converters.target_facts import rope_dict, target_rope_dicts, target_text_config

__all__ = ["ARCHITECTURE", "HEAD_FORMAT", "check_eagle1_head", "eagle1_shape", "expected_eagle1_weights",
           "is_eagle1_config"]

_REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers")
# tensors an EAGLE-1 head must not carry, and why
_REFUSED = {
    "fc.bias": "vLLM's EAGLE-1 fc has no bias (ReplicatedLinear(bias=False)) and refuses the tensor",
    "layers.0.input_layernorm.weight": "vLLM replaces the first layer's input_layernorm by the identity and cannot "
                                       "place this weight",
    "norm.weight": "vLLM's EagleLlamaForCausalLM has no final norm: the target's lm_head reads the layer's output",
    "lm_head.weight": "vLLM's EagleLlamaForCausalLM has no lm_head of its own (it takes the target's)",
    "d2t": "an EAGLE-1 head drafts over the whole target vocab; vLLM has no draft vocab map for it",
    "t2d": "an EAGLE-1 head drafts over the whole target vocab; vLLM has no draft vocab map for it",
}


def is_eagle1_config(conf: Mapping) -> bool:
    return list(conf.get("architectures") or []) == [ARCHITECTURE]


class Eagle1Shape:
    """The config fields EAGLE1_WEIGHTS reads, from a head's config.json."""

    def __init__(self, conf: Mapping):
        self.hidden_size = int(conf["hidden_size"])
        self.num_attention_heads = int(conf["num_attention_heads"])
        self.num_key_value_heads = int(conf.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim = int(conf.get("head_dim") or self.hidden_size // self.num_attention_heads)
        self.intermediate_size = int(conf["intermediate_size"])


def eagle1_shape(conf: Mapping) -> Eagle1Shape:
    return Eagle1Shape(conf)


def expected_eagle1_weights(conf: Mapping) -> dict[str, weights.Entry]:
    """file name -> table entry of every weight the config implies."""
    return {e.file_name: e for e in weights.entries(EAGLE1_WEIGHTS, eagle1_shape(conf))}


def check_eagle1_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping] = None,
                      check_finite: bool = True) -> list[Finding]:
    """Every rule above on a config.json dict and the tensors; returns the findings."""
    findings: list[Finding] = []

    def bad(rule, field, problem, fix, level="error"):
        findings.append(Finding(rule, field, problem, fix, level))

    if not is_eagle1_config(config):
        bad("config.architectures", "architectures", f"{config.get('architectures')!r} is not [{ARCHITECTURE!r}]",
            f"write architectures [{ARCHITECTURE!r}] (vLLM's registry name for its EAGLE-1 Llama head)")
    if config.get("model_type") != "llama":
        bad("config.model_type", "model_type", f"{config.get('model_type')!r}: vLLM parses the head as a LlamaConfig",
            "write model_type \"llama\"")
    missing = [k for k in _REQUIRED if config.get(k) is None]
    if missing:
        bad("config.required", ", ".join(missing), "missing from config.json", "export the head with specjax.export")
        return findings
    if int(config["num_hidden_layers"]) != 1:
        bad("config.num_hidden_layers", "num_hidden_layers", f"{config['num_hidden_layers']}: specjax trains and "
            "reads one-layer EAGLE-1 heads", "export a one-layer head (num_hidden_layers 1)")
    V = int(config["vocab_size"])
    if int(config.get("draft_vocab_size") or V) != V:
        bad("config.draft_vocab_size", "draft_vocab_size", f"{config['draft_vocab_size']} != vocab_size {V}: vLLM's "
            "EAGLE-1 head scores the whole vocab with the target's lm_head", "drop draft_vocab_size")
    if config.get("tie_word_embeddings"):
        bad("config.tie_word_embeddings", "tie_word_embeddings", "true in a head without an lm_head of its own",
            "write tie_word_embeddings false")
    _check_tensors(config, tensors, bad, check_finite)
    if target_config is not None:
        _check_target(config, target_config, bad)
    return findings


def _check_tensors(config, tensors: HeadTensors, bad, check_finite: bool) -> None:
    prefixed = [k for k in tensors.names if k.startswith("model.")]
    if prefixed:
        bad("keys.prefix", "model.*", f"{len(prefixed)} key(s) carry a model. prefix, e.g. {prefixed[0]} (vLLM adds "
            "`model.` itself)", "save the head's own keys: fc.weight, layers.0.*")
    try:
        expected = expected_eagle1_weights(config)
    except (KeyError, TypeError, ValueError) as e:
        bad("config.required", "config", f"cannot derive the tensor shapes ({e!r})", "write the decoder shape keys")
        return
    for k in expected:
        if k not in tensors:
            bad("keys.missing", k, "missing from the weights (vLLM would run it uninitialised)",
                "export every tensor of specjax.drafts.eagle1_weights.EAGLE1_WEIGHTS")
    for k in tensors.names:
        if k in expected or k == "embed_tokens.weight" or k in prefixed:
            continue
        why = _REFUSED.get(k, "not part of vLLM's EagleLlamaForCausalLM, which refuses a tensor it cannot place")
        bad("keys.unknown", k, why, "remove it: an EAGLE-1 head holds fc.weight and layers.0.* only")
    check_embedding_copy(config, tensors, bad, shape_fix="drop embed_tokens (vLLM shares the target's)",
                         copy_problem="a copy of an embedding is shipped (vLLM keeps it when it differs from the "
                         "target's; specjax trains and decodes with the target's)",
                         copy_fix="drop embed_tokens.weight: vLLM then shares the target's embedding")
    for k, e in expected.items():
        if k in tensors and tuple(tensors.shape(k)) != e.file_shape:
            bad("shapes", k, f"shape {tuple(tensors.shape(k))} but config.json implies {e.file_shape}",
                "export the config the weights were trained with (hidden_size, heads, head_dim, intermediate_size)")
    check_weight_dtypes(config, tensors, [k for k in expected if k in tensors], bad, check_finite,
                        {k: e.file_shape for k, e in expected.items()})


def _check_target(config, target_config, bad) -> None:
    tc = target_text_config(target_config)
    H, V = int(config["hidden_size"]), int(config["vocab_size"])
    if tc.get("hidden_size") is not None and H != int(tc["hidden_size"]):
        bad("target.hidden_size", "hidden_size", f"draft {H} != target {tc['hidden_size']}: the head reads the "
            "target's final hidden state and embeds with its table", "serve it with the target it was trained on")
    if tc.get("vocab_size") is not None and V != int(tc["vocab_size"]):
        bad("target.vocab_size", "vocab_size", f"draft {V} != target {tc['vocab_size']}: the target's lm_head scores "
            "the head's output", "serve it with the target it was trained on")
    mine, theirs = rope_dict(config), rope_dict(tc)
    if theirs is None:
        theirs = {"rope_type": "default", "rope_theta": 10000.0}
    if mine is not None and not any(same_value(mine, t) for t in target_rope_dicts(tc) or [theirs]):
        bad("target.rope", "rope_parameters", f"draft RoPE {mine} != target RoPE {theirs} (the draft rows sit at the "
            "target's positions)", "copy the target's rope_theta / rope_scaling / rope_parameters into the draft config")


def check_folder_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                      training_ids: Optional[Sequence[int]], manifest: Optional[Mapping],
                      check_finite: bool) -> list[Finding]:
    """`check_eagle1_head` for the folder dispatch (an EAGLE-1 head reads no taps: training_ids unused)."""
    return check_eagle1_head(config, tensors, target_config=target_config, check_finite=check_finite)


# the folder dispatch's entry (specjax_converters.head_formats)
HEAD_FORMAT = HeadFormat(name="eagle1", recognises=is_eagle1_config, layout=lambda config: "eagle1",
                         check=check_folder_head)

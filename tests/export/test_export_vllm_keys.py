"""vLLM's weight-name mapping for Llama EAGLE-3 drafts, applied to our exported keys.

vLLM is not installed here (GPU-only). The test spells out its documented loading path
(docs/eagle3-format.md, "How engines load the weights"; vllm/model_executor/models/llama_eagle3.py,
2026 main):
  Eagle3LlamaForCausalLM.load_weights: skip `t2d`; `d2t` -> `draft_id_to_target_id`; every other
    name without "lm_head" gets the `model.` prefix; AutoWeightsLoader then hands `model.*` to
  LlamaModel.load_weights: `midlayer.` -> `layers.0.`; q/k/v_proj -> qkv_proj (shards q, k, v),
    gate/up_proj -> gate_up_proj (shards 0, 1); any other name must be a parameter (KeyError if not).
and compares the result with the parameters vLLM's draft has for the exported config (tp = 1;
vLLM pads vocab rows to a multiple of 64 inside the parameter, its loader checks the unpadded
count, which is what is compared here). Every exported key must land on a parameter, every
parameter must be filled (embed_tokens is shared from the target when the file has none), and the
stacked shards must add up to the fused shapes.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from export._heads import make_draft
from specjax_converters.eagle3_export import export_eagle3

_STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def vllm_draft_params(conf: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> logical shape of vLLM's Eagle3LlamaForCausalLM for this draft config."""
    H, nH = conf["hidden_size"], conf["num_attention_heads"]
    nKV, hd = conf.get("num_key_value_heads", nH), conf.get("head_dim") or H // nH
    inter, tH = conf["intermediate_size"], conf.get("target_hidden_size", H)
    Vd = conf.get("draft_vocab_size") or conf["vocab_size"]
    eagle = conf.get("eagle_config") or {}
    n_aux = conf.get("num_aux_hidden_states") or len(eagle.get("eagle_aux_hidden_state_layer_ids") or []) or 3
    out = {"model.embed_tokens.weight": (conf["vocab_size"], H)}
    for i in range(conf["num_hidden_layers"]):  # layer 0's qkv reads [embeds, hidden] (2H)
        qkv_in = 2 * H if i == 0 else H
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.qkv_proj.weight": ((nH + 2 * nKV) * hd, qkv_in),
            p + "self_attn.o_proj.weight": (H, nH * hd),
            p + "mlp.gate_up_proj.weight": (2 * inter, H),
            p + "mlp.down_proj.weight": (H, inter),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "hidden_norm.weight": (H,),
        })
    if eagle.get("use_aux_hidden_state", True):
        out["model.fc.weight"] = (H, n_aux * tH)
        if conf.get("fc_norm"):
            out.update({f"model.fc_norm.{i}.weight": (tH,) for i in range(n_aux)})
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (Vd, H)
    out["draft_id_to_target_id"] = (Vd,)
    return out


def vllm_load(conf: dict, tensors: dict[str, np.ndarray]) -> dict:
    """Run the documented mapping; returns {param: {shard_id: shape}} and raises KeyError on a name
    vLLM has no parameter for (AutoWeightsLoader / params_dict raise there)."""
    params = vllm_draft_params(conf)
    renamed = {}
    for name, w in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        renamed[name] = w
    loaded: dict[str, dict] = {}
    for name, w in renamed.items():
        if name.startswith("model."):
            inner = name[len("model."):]
            if "midlayer." in inner:
                inner = inner.replace("midlayer.", "layers.0.")
            for fused, part, shard in _STACKED:
                if part in inner:
                    target = "model." + inner.replace(part, fused)
                    if target not in params:
                        raise KeyError(target)
                    loaded.setdefault(target, {})[shard] = tuple(w.shape)
                    break
            else:
                target = "model." + inner
                if target not in params:
                    raise KeyError(target)
                loaded.setdefault(target, {})[None] = tuple(w.shape)
        else:
            if name not in params:
                raise KeyError(name)
            loaded.setdefault(name, {})[None] = tuple(w.shape)
    return loaded


def check_against_vllm(conf: dict, tensors: dict) -> list[str]:
    """Problems a vLLM load of these tensors would have (empty = loads completely)."""
    params = vllm_draft_params(conf)
    try:
        loaded = vllm_load(conf, tensors)
    except KeyError as e:
        return [f"no vLLM parameter {e.args[0]} (AutoWeightsLoader raises)"]
    problems = []
    skipped = {"model.embed_tokens.weight"} if "embed_tokens.weight" not in tensors else set()
    for name, shape in params.items():
        if name in skipped:
            continue
        if name not in loaded:
            problems.append(f"{name} not loaded")
            continue
        shards = loaded[name]
        if name.endswith("qkv_proj.weight"):
            if set(shards) != {"q", "k", "v"}:
                problems.append(f"{name} shards {sorted(map(str, shards))}")
                continue
            got = (sum(shards[s][0] for s in "qkv"), shards["q"][1])
        elif name.endswith("gate_up_proj.weight"):
            if set(shards) != {0, 1}:
                problems.append(f"{name} shards {sorted(map(str, shards))}")
                continue
            got = (shards[0][0] + shards[1][0], shards[0][1])
        else:
            got = shards[None]
        if tuple(got) != tuple(shape):
            problems.append(f"{name}: file gives {got}, vLLM expects {shape}")
    return problems


@pytest.fixture(scope="module", params=["eagle3", "eagle3.1"])
def exported(request, tmp_path_factory):
    is31 = request.param == "eagle3.1"
    target_hf, cfg, params, vocab = make_draft(seed=2, fc_norm=is31, norm_output=is31)
    out = export_eagle3(params, cfg, vocab, target_hf, tmp_path_factory.mktemp("vllm") / "e", dtype="fp32")
    import json

    conf = json.loads(open(os.path.join(out, "config.json")).read())
    return conf, load_file(os.path.join(out, "model.safetensors"))


def test_every_exported_key_maps_onto_vllm_params(exported):
    conf, tensors = exported
    assert check_against_vllm(conf, tensors) == []
    loaded = vllm_load(conf, tensors)
    # nothing left over: every tensor except t2d (skipped by design) landed on a parameter
    n_shards = sum(len(v) for v in loaded.values())
    assert n_shards == len(tensors) - 1
    assert set(loaded) == set(vllm_draft_params(conf)) - {"model.embed_tokens.weight"}
    if conf.get("fc_norm"):
        assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= set(loaded)


@pytest.mark.parametrize("defect", ["model_prefix", "unknown_key", "no_d2t", "no_q_proj", "layers_1"])
def test_the_mapping_catches_broken_heads(exported, defect):
    """The same check fails for the layouts that break in vLLM (so the test above can fail)."""
    conf, tensors = exported
    tensors = dict(tensors)
    if defect == "model_prefix":  # becomes model.model.* (docs/eagle3-format.md, "How engines load the weights")
        tensors = {("model." + k if k not in ("d2t", "t2d") else k): v for k, v in tensors.items()}
    elif defect == "unknown_key":
        tensors["aux_norm_low.weight"] = np.ones(4, np.float32)
    elif defect == "no_d2t":  # draft_id_to_target_id would stay zeros: identity mapping
        del tensors["d2t"]
    elif defect == "no_q_proj":
        del tensors["midlayer.self_attn.q_proj.weight"]
    else:  # the decoder saved under another layer index
        tensors = {k.replace("midlayer.", "layers.1."): v for k, v in tensors.items()}
    assert check_against_vllm(conf, tensors) != []

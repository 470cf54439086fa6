"""Real DFlash 2, DSpark and XPress exports against vLLM 0.34.0's loaders, as facts
(tests/unit/vllm034_loader_facts.py: the config.json keys 0.34 reads, the renaming its load_weights
applies, the parameters the tensors land in, each with its vllm-0.34.0 FILE:LINE). No vLLM, no
network: the exporters write tiny heads (random weights, 2 layers) and the checks read their
config.json and safetensors header.

For each DFlash 2 / DSpark export:
  * every key 0.34 reads is there with its JSON type, and none it would read instead is;
  * what 0.34 derives from them (the taps, the mask token, the attention's causality, the block the
    convolution or the query slots span for the num_speculative_tokens serve_cmd passes, the method)
    is what the head was trained with;
  * every tensor, renamed as 0.34 renames it, lands in a parameter of the shape 0.34 builds from that
    config (stacked q/k/v and gate/up checked shard by shard), with an integer d2t and float weights;
  * every parameter 0.34 does not take from the target is in the file (0.34 would leave it unset
    without an error).
The same check runs on the XPress export of a head trained with draft.xpress_slot0_prev=anchor,
which is written in 0.34's own XPress layout (Qwen3XPressModel): every key, the derived block / rank
/ MLP width / passes / exact scoring (xpress_topc 0) / slot-0 convention / method, every tensor on a
parameter of its shape. A DSpark head with the gated Markov head fails the check (0.34 builds the
first-order one only), and a speculators-layout XPress export (the default, before_anchor) is not read
at all; its tensors do map, by renaming alone, onto 0.34's layout (XPRESS_FROM_SPECJAX).
test_check_can_fail breaks one name, shape or key at a time.
"""
from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest

from unit import vllm034_loader_facts as F

V, H, I, NH, NKV, HD, VD = 50, 32, 64, 4, 2, 8, 24
TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
          "num_hidden_layers": 4, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
          "rope_theta": 10000.0, "max_position_embeddings": 256, "eos_token_id": 1}
FLOATS = ("F32", "BF16", "F16")


# ---------------------------------------------------------------------------------------------
# the exports
# ---------------------------------------------------------------------------------------------
def _base(vd=V, block_size=4, sample_from_anchor=False):
    from specjax.drafts.dflash import DFlashConfig
    from specjax.layers.rope import RopeSpec

    return DFlashConfig(hidden_size=H, num_layers=2, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                        intermediate_size=I, vocab_size=V, draft_vocab_size=vd, aux_layer_ids=(0, 2),
                        mask_token_id=V - 1, block_size=block_size, rms_norm_eps=1e-6,
                        rope=RopeSpec("default", 10000.0), max_position_embeddings=256, num_target_layers=4,
                        sample_from_anchor=sample_from_anchor)


def _params(table, cfg, seed=0):
    from specjax.drafts import weights

    rng = np.random.default_rng(seed)
    return weights.nest([(e.path, (0.1 * rng.standard_normal(e.shape)).astype(np.float32))
                         for e in weights.entries(table, cfg)])


def _vocab(vd):
    from specjax.drafts.vocab import DraftVocab

    return None if vd == V else DraftVocab.from_ids(np.random.default_rng(0).choice(V, vd, replace=False), V)


def export_dflash2(out):
    from specjax.drafts import dflash2
    from specjax.drafts.dflash2_family import DFLASH2

    cfg = dflash2.as_dflash2(_base(), conv_group_size=8, selector_rank=8, selector_top_k=8)
    return DFLASH2.export(_params(dflash2.DFLASH2_WEIGHTS, cfg), cfg, None, TARGET, out, dtype="bfloat16"), cfg, DFLASH2


def export_dspark(out, vd=VD, confidence=True, with_markov=True, sample_from_anchor=True, head_type="vanilla"):
    from specjax.drafts import dspark
    from specjax.drafts.dspark_family import DSPARK

    cfg = dspark.as_dspark(_base(vd, sample_from_anchor=sample_from_anchor), markov_rank=6, markov_head_type=head_type,
                           enable_confidence_head=confidence, confidence_head_with_markov=confidence and with_markov)
    return (DSPARK.export(_params(dspark.DSPARK_WEIGHTS, cfg), cfg, _vocab(vd), TARGET, out, dtype="bfloat16"), cfg,
            DSPARK)


def export_xpress(out):
    from specjax.drafts import xpress
    from specjax.drafts.xpress_family import XPRESS

    cfg = xpress.as_xpress(_base(), xpress_rank=8, xpress_mlp_ratio=2, num_jacobi_passes=3)
    return XPRESS.export(_params(xpress.XPRESS_WEIGHTS, cfg), cfg, None, TARGET, out, dtype="bfloat16"), cfg, XPRESS


def export_xpress034(out, block_size=4):
    """An XPress head trained with vLLM 0.34's slot-0 convention: exported in 0.34's own layout."""
    from specjax.drafts import xpress
    from specjax.drafts.xpress_family import XPRESS

    cfg = xpress.as_xpress(_base(block_size=block_size), xpress_rank=8, xpress_mlp_ratio=3, num_jacobi_passes=2,
                           xpress_slot0_prev="anchor")
    return XPRESS.export(_params(xpress.XPRESS_WEIGHTS, cfg), cfg, None, TARGET, out, dtype="bfloat16"), cfg, XPRESS


def read_folder(folder):
    """(config.json, {tensor name: (safetensors dtype, shape)}) from the header alone."""
    conf = json.load(open(os.path.join(folder, "config.json")))
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return conf, {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


# ---------------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------------
TYPES = {"int": lambda x: isinstance(x, int) and not isinstance(x, bool), "bool": lambda x: isinstance(x, bool),
         "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
         "str": lambda x: isinstance(x, str), "dict": lambda x: isinstance(x, dict),
         "int_list": lambda x: isinstance(x, list) and all(TYPES["int"](i) for i in x),
         "str_list": lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x), "any": lambda x: True}
MISSING = object()


def lookup(conf, path):
    node = conf
    for part in path.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return MISSING
    return node


def check_keys(conf, keys, absent=()):
    out = []
    for path, kind, required, src in keys:
        value = lookup(conf, path)
        if value is MISSING or value is None and kind != "any":
            if required:
                out.append(f"config: {path} missing; vLLM 0.34 reads it ({src})")
        elif not TYPES[kind](value):
            out.append(f"config: {path}={value!r} is not {kind} ({src})")
    out += [f"config: {path} is set; vLLM 0.34 would read it ({src})" for path, src in absent
            if lookup(conf, path) is not MISSING]
    return out


def vllm_name(name, renames):
    """(parameter, shard) 0.34 loads the file's tensor `name` into, None if it drops it, "refused"."""
    shard = None
    for step in renames:
        op, a = step[0], step[1]
        if op == "refuse" and a in name:
            return "refused"
        if op == "skip" and a in name:
            return None
        if op == "sub" and a in name:
            name = name.replace(a, step[2], 1)
        if op == "prefix" and not any(u in name for u in step[2]):
            name = a + name
        if op == "stack" and a in name and shard is None:
            name, shard = name.replace(a, step[2], 1), step[3]
    return name, shard


def expand(params, view):
    """{concrete parameter name: (shape or {shard: shape}, need, source)} for the view's layer count."""
    out = {}
    for name, (shape, need, src) in params.items():
        for i in (range(view["L"]) if "{i}" in name else (None,)):
            out[name.replace("{i}", str(i)) if i is not None else name] = (shape(view), need, src)
    return out


def exists(need, view):
    return {"required": True, "optional": True, "if_d2t": view["has_d2t"], "own_if_d2t": True,
            "if_confidence": view.get("confidence", False)}[need]


def needed(need, view):
    """Whether the file must hold the parameter (0.34 leaves it unset, with no error, if not)."""
    return exists(need, view) and (need != "optional") and (need != "own_if_d2t" or view["has_d2t"])


def check_tensors(tensors, renames, params, view):
    """Every tensor lands in a parameter of its shape; every parameter not shared from the target is loaded."""
    out, table, loaded = [], expand(params, view), {}
    for name, (dtype, shape) in sorted(tensors.items()):
        target = vllm_name(name, renames)
        if target == "refused":
            out.append(f"tensor {name}: vLLM 0.34 refuses a checkpoint with it")
            continue
        if target is None:
            continue
        param, shard = target
        if param not in table or not exists(table[param][1], view):
            out.append(f"tensor {name}: vLLM 0.34 has no parameter {param} for it")
            continue
        want, _, src = table[param]
        if isinstance(want, dict) != (shard is not None) or (shard is not None and shard not in want):
            out.append(f"tensor {name}: {param} is {'stacked' if isinstance(want, dict) else 'not stacked'} ({src})")
            continue
        want = want[shard] if shard is not None else want
        if shape != tuple(want):
            out.append(f"tensor {name}: shape {shape}, vLLM 0.34 builds {param} as {tuple(want)} ({src})")
        if param == "draft_id_to_target_id" and not dtype.startswith(("I", "U")):
            out.append(f"tensor {name}: dtype {dtype}; 0.34's draft_id_to_target_id is int64 offsets ({src})")
        elif param != "draft_id_to_target_id" and dtype not in FLOATS:
            out.append(f"tensor {name}: dtype {dtype} is not a float dtype ({src})")
        loaded.setdefault(param, set()).add(shard)
    for param, (want, need, src) in table.items():
        if not needed(need, view):
            continue
        missing = (set(want) if isinstance(want, dict) else {None}) - loaded.get(param, set())
        if missing:
            which = f" (shards {', '.join(sorted(map(str, missing)))})" if isinstance(want, dict) else ""
            out.append(f"parameter {param}: not in the file{which}; vLLM 0.34 would leave it unset ({src})")
    return out


def check_dflash2(conf, tensors, cfg, family, folder):
    out = check_keys(conf, F.DFLASH2_KEYS, F.DFLASH2_ABSENT)
    if conf.get("speculators_model_type") not in F.SPECULATORS_TYPES:
        out.append(f"config: speculators_model_type {conf.get('speculators_model_type')!r} is not one 0.34 reads")
    if out:
        return out
    v = F.dflash2_view(conf, TARGET["vocab_size"])
    spec = family.vllm_speculative_config(folder, conf, 7)
    out += _expect(v, {
        "method": spec["method"], "target_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id,
        "causal": bool(cfg.causal), "sample_from_anchor": False, "H": cfg.hidden_size, "V": cfg.vocab_size,
        "Vd": cfg.draft_vocab_size, "taps": cfg.conv_kernel_size, "group": cfg.conv_group_size,
        "rank": cfg.selector_rank, "top_k": cfg.selector_top_k,
        "num_speculative_tokens": spec["num_speculative_tokens"]})
    if v["conv_block"](spec["num_speculative_tokens"]) != cfg.block_size:
        out.append(f"view: 0.34's convolution spans {v['conv_block'](spec['num_speculative_tokens'])} slots for "
                   f"num_speculative_tokens={spec['num_speculative_tokens']}; the head was trained on {cfg.block_size}")
    return out + check_tensors(tensors, F.DFLASH2_RENAMES, F.DFLASH2_PARAMS, v)


def check_dspark(conf, tensors, cfg, family, folder):
    out = check_keys(conf, F.DSPARK_KEYS, F.DSPARK_ABSENT)
    if out:
        return out
    if conf["architectures"] != ["Qwen3DSparkModel"]:
        out.append(f"config: architectures {conf['architectures']}; 0.34 registers Qwen3DSparkModel (registry.py:711)")
    v = F.dspark_view(conf, TARGET["vocab_size"])
    spec = family.vllm_speculative_config(folder, conf, 7)
    out += _expect(v, {
        "method": spec["method"], "target_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id,
        "causal": bool(cfg.causal), "sample_from_anchor": bool(cfg.sample_from_anchor), "H": cfg.hidden_size,
        "V": cfg.vocab_size, "Vd": cfg.draft_vocab_size, "markov_rank": cfg.markov_rank,
        "confidence": bool(cfg.enable_confidence_head), "conf_markov": bool(cfg.confidence_head_with_markov)})
    if v["query_slots"](spec["num_speculative_tokens"]) != cfg.block_size:
        out.append(f"view: 0.34 drafts {v['query_slots'](spec['num_speculative_tokens'])} query slots for "
                   f"num_speculative_tokens={spec['num_speculative_tokens']}; the head was trained on {cfg.block_size}")
    return out + check_tensors(tensors, F.DSPARK_RENAMES, F.DSPARK_PARAMS, v)


def check_xpress034(conf, tensors, cfg, family, folder):
    out = check_keys(conf, F.XPRESS_KEYS, F.XPRESS_ABSENT)
    if out:
        return out
    if conf["architectures"] != ["Qwen3XPressModel"]:
        out.append(f"config: architectures {conf['architectures']}; 0.34 registers Qwen3XPressModel (registry.py:716)")
    v = F.xpress_view(conf, TARGET["vocab_size"])
    spec = family.vllm_speculative_config(folder, conf, 7)
    out += _expect(v, {
        "method": spec["method"], "target_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id,
        "causal": bool(cfg.causal), "sample_from_anchor": bool(cfg.sample_from_anchor), "H": cfg.hidden_size,
        "V": cfg.vocab_size, "Vd": cfg.draft_vocab_size, "B": cfg.block_size, "r": cfg.xpress_rank,
        "m": cfg.xpress_rank * cfg.xpress_mlp_ratio, "passes": cfg.num_jacobi_passes, "topc": 0,
        "full_vocab": True, "slot0_prev": cfg.xpress_slot0_prev})
    if v["query_slots"](spec["num_speculative_tokens"]) != v["B"]:
        out.append(f"view: 0.34 drafts {v['query_slots'](spec['num_speculative_tokens'])} query slots for "
                   f"num_speculative_tokens={spec['num_speculative_tokens']}; its refiner's mixer is "
                   f"xpress_block_size={v['B']} wide")
    return out + check_tensors(tensors, F.XPRESS_RENAMES, F.XPRESS_PARAMS, v)


def _expect(view, want):
    return [f"view: 0.34 derives {k}={view[k]!r} from config.json; the head was trained with {w!r}"
            for k, w in want.items() if view[k] != w]


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("v034")
    return {"dflash2": export_dflash2(root / "dflash2"), "dspark": export_dspark(root / "dspark"),
            "dspark_full": export_dspark(root / "dspark_full", vd=V, confidence=False, sample_from_anchor=False),
            "xpress": export_xpress(root / "xpress"), "xpress034": export_xpress034(root / "xpress034")}


CHECKS = {"dflash2": check_dflash2, "dspark": check_dspark, "dspark_full": check_dspark, "xpress034": check_xpress034}


@pytest.mark.parametrize("kind", sorted(CHECKS))
def test_export_loads_in_vllm034(heads, kind):
    folder, cfg, family = heads[kind]
    conf, tensors = read_folder(folder)
    problems = CHECKS[kind](conf, tensors, cfg, family, folder)
    assert problems == [], "\n".join(problems)


def test_dspark_gated_markov_head_does_not_load(tmp_path):
    """0.34 builds only the first-order Markov head (serve_plan refuses the others for the same reason)."""
    folder, cfg, family = export_dspark(tmp_path / "gated", head_type="gated")
    conf, tensors = read_folder(folder)
    problems = check_dspark(conf, tensors, cfg, family, folder)
    assert any("markov_head.gate_proj.weight" in p and "no parameter" in p for p in problems), problems
    assert conf["markov_head_type"] not in F.DSPARK_MARKOV_HEAD_TYPES


def test_xpress_export_is_not_read_by_vllm034_but_renames_onto_its_layout(heads):
    folder, cfg, _ = heads["xpress"]
    conf, tensors = read_folder(folder)
    # 0.34's speculators reader has no "xpress", so it refuses this folder (README: serving table)
    assert conf["speculators_model_type"] == "xpress" and "xpress" not in F.SPECULATORS_TYPES
    # 0.34's own layout: our config and tensor renames (vllm034_loader_facts.XPRESS_FROM_SPECJAX)
    layer = dict(conf["transformer_layer_config"])
    converted = {**layer, "architectures": ["Qwen3XPressModel"], "model_type": "qwen3",
                 "draft_vocab_size": conf["draft_vocab_size"], "target_hidden_size": conf["target_hidden_size"],
                 "xpress_block_size": conf["block_size"], "xpress_rank": conf["xpress_rank"],
                 "xpress_mlp_hidden": conf["xpress_rank"] * conf["xpress_mlp_ratio"],
                 "xpress_num_passes": conf["num_jacobi_passes"], "xpress_topc": 0,
                 "sample_from_anchor": conf["sample_from_anchor"], "mask_token_id": conf["mask_token_id"],
                 "target_layer_ids": [i - 1 for i in conf["aux_hidden_state_layer_ids"]]}
    renamed = {F.XPRESS_FROM_SPECJAX.get(k, k): v for k, v in tensors.items()}
    assert sum(k.startswith("refiner_head.") for k in tensors) == len(F.XPRESS_FROM_SPECJAX)
    assert check_keys(converted, F.XPRESS_KEYS) == []
    v = F.xpress_view(converted, TARGET["vocab_size"])
    assert v["full_vocab"] and not v["sample_from_anchor"] and not v["causal"]
    assert (v["B"], v["r"], v["m"], v["passes"]) == (cfg.block_size, cfg.xpress_rank,
                                                    cfg.xpress_rank * cfg.xpress_mlp_ratio, cfg.num_jacobi_passes)
    problems = check_tensors(renamed, F.XPRESS_RENAMES, F.XPRESS_PARAMS, v)
    assert problems == [], "\n".join(problems)


def _rename(old, new):
    return lambda conf, t: t.__setitem__(new, t.pop(old))


def _set(path, value):
    def edit(conf, t):
        node, parts = conf, path.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is MISSING:
            del node[parts[-1]]
        else:
            node[parts[-1]] = value
    return edit


MUTATIONS = [  # (head, what, edit(conf, tensors), a phrase the problems must contain)
    ("dflash2", "a conv tensor renamed", _rename("layers.1.mlp_conv.base_kernel", "layers.1.mlp_convs.base_kernel"),
     "no parameter model.layers.1.mlp_convs.base_kernel"),
    ("dflash2", "the selector projection transposed",
     lambda c, t: t.__setitem__("candidate_selector.hidden_projection.weight", ("BF16", (H, 8))), "shape (32, 8)"),
    ("dflash2", "q_proj missing", lambda c, t: t.pop("layers.0.self_attn.q_proj.weight"), "(shards q)"),
    ("dflash2", "selector_top_k missing", _set("selector_top_k", MISSING), "selector_top_k missing"),
    ("dflash2", "taps written 0-based", _set("aux_hidden_state_layer_ids", [0, 2]), "target_layer_ids"),
    ("dflash2", "causal attention", _set("sliding_window_non_causal", False), "causal=True"),
    ("dflash2", "a speculators type 0.34 lacks", _set("speculators_model_type", "dflash3"), "is not one 0.34 reads"),
    ("dspark", "markov_w1 renamed", _rename("markov_head.markov_w1.weight", "markov_head.w1.weight"),
     "parameter model.markov_head.markov_w1.weight: not in the file"),
    ("dspark", "d2t dropped", lambda c, t: t.pop("d2t"), "parameter draft_id_to_target_id: not in the file"),
    ("dspark", "lm_head of a smaller vocab dropped", lambda c, t: t.pop("lm_head.weight"),
     "parameter lm_head.weight: not in the file"),
    ("dspark", "d2t as floats", lambda c, t: t.__setitem__("d2t", ("F32", (VD,))), "int64"),
    ("dspark", "confidence head without the Markov code", _set("confidence_head_with_markov", False),
     "confidence_head.proj.weight: shape (1, 38)"),
    ("dspark", "a dflash_config block", _set("dflash_config", {"mask_token_id": 3}), "dflash_config is set"),
    ("dspark", "block_size off by one", _set("block_size", 5), "query slots"),
    ("dspark_full", "markov_rank a string", _set("markov_rank", "6"), "markov_rank='6' is not int"),
    ("xpress034", "the embedding under speculators' name",
     _rename("xpress_head.w1.weight", "xpress_head.token_embed.weight"),
     "no parameter model.xpress_head.token_embed.weight"),
    ("xpress034", "the raw mixer missing", lambda c, t: t.pop("xpress_head.mix.L"),
     "parameter model.xpress_head.mix.L: not in the file"),
    ("xpress034", "the readout transposed", lambda c, t: t.__setitem__("xpress_head.w2.weight", ("BF16", (8, V))),
     "shape (8, 50)"),
    ("xpress034", "xpress_mlp_hidden missing (0.34: 512)", _set("xpress_mlp_hidden", MISSING), "m=512"),
    ("xpress034", "top-C scoring on", _set("xpress_topc", MISSING), "topc=512"),
    ("xpress034", "block off the trained one", _set("xpress_block_size", 5), "B=5"),
    ("xpress034", "mask token left in a dflash_config", _set("dflash_config", {"mask_token_id": 3}),
     "dflash_config is set"),
    ("xpress034", "taps written speculators-style only", _set("target_layer_ids", MISSING),
     "target_layer_ids missing"),
]


@pytest.mark.parametrize("kind,what,edit,phrase", MUTATIONS, ids=[f"{m[0]}: {m[1]}" for m in MUTATIONS])
def test_check_can_fail(heads, kind, what, edit, phrase):
    folder, cfg, family = heads[kind]
    conf, tensors = read_folder(folder)
    assert CHECKS[kind](conf, tensors, cfg, family, folder) == []
    conf = json.loads(json.dumps(conf))
    edit(conf, tensors)
    problems = CHECKS[kind](conf, tensors, cfg, family, folder)
    assert any(phrase in p for p in problems), (what, problems)


def test_facts_cite_a_vllm_file_and_line():
    """Every key and parameter fact names where in vllm-0.34.0 it comes from."""
    cite = re.compile(r"[\w/]+\.py:\d+")
    for table in (F.DFLASH2_KEYS, F.DSPARK_KEYS, F.XPRESS_KEYS):
        assert all(cite.search(src) for *_, src in table)
    for table in (F.DFLASH2_ABSENT, F.DSPARK_ABSENT, F.XPRESS_ABSENT):
        assert all(cite.search(src) for _, src in table)
    for table in (F.DFLASH2_PARAMS, F.DSPARK_PARAMS, F.XPRESS_PARAMS):
        assert all(cite.search(src) for _, _, src in table.values())


def test_p_eagle_serve_config_is_one_vllm034_refuses():
    """The speculative config specjax.serve_cmd gives vLLM for a P-EAGLE head (vLLM 0.32 serves it: the engine
    tier) asks for parallel drafting with method eagle3, which vLLM 0.34 refuses (the export's serving
    warning says so). A plain EAGLE-3 head's config does not ask for it."""
    from specjax.drafts.eagle3_family import EAGLE3, P_EAGLE

    assert re.search(r"[\w/]+\.py:\d+", F.PARALLEL_DRAFTING_SOURCE)
    spec = P_EAGLE.vllm_speculative_config("head", {"mask_token_id": 2}, 5)
    assert spec.get("parallel_drafting") is True and spec["method"] not in F.PARALLEL_DRAFTING_METHODS
    assert "parallel_drafting" not in EAGLE3.vllm_speculative_config("head", {}, 5)
    assert "peagle" in F.SPECULATORS_TYPES  # registered by 0.34 only to refuse it


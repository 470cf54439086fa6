"""Import a published EAGLE-3 draft head into specjax draft params (warm start, re-export, eval).

Reads the two layouts other trainers publish (docs/eagle3-format.md, "Layouts other trainers publish"):
  * Llama-EAGLE3 (SpecForge, official EAGLE, specjax exports): `midlayer.*` keys, config.json with
    `LlamaForCausalLMEagle3`, aux ids in `eagle_config` (output-of-layer) and/or top level (input);
  * speculators: `layers.0.*` keys, `speculators_model_type: eagle3`, decoder fields in
    `transformer_layer_config`, top-level aux ids in vLLM's input-of-layer convention.
Which file tensor becomes which param leaf, and which are transposed (HF `[out, in]` -> kernel
`[in, out]`), comes from the weight table (specjax.drafts.weights); the values and their dtype are
kept, so import -> export in the file's dtype reproduces the tensors bit for bit.

Heads that specjax cannot run the same way (norm_before_residual, norm_before_fc/input_norm, more
than one layer, biases) are refused with the reason: training from them would change their function.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping, Optional

import numpy as np

from specjax.aux_ids import default_aux_layer_ids
from specjax.drafts import weights
from specjax_converters.eagle3_validate import LEGACY_AUX_NORMS, expected_weights, flatten_head_config, key_layout
from specjax_converters.head_files import read_head_files
from specjax_converters.head_rules import EMBED_KEY
from specjax_converters.target_facts import target_virtual_depth
from specjax_converters.warm_start import params_like

__all__ = ["ImportedHead", "read_head", "warm_start_params"]

log = logging.getLogger("specjax")
_IGNORED_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclasses.dataclass(frozen=True)
class ImportedHead:
    params: dict  # specjax draft pytree (docs/INTERFACES.md), numpy arrays in the file's dtype
    config: Any  # specjax.drafts.eagle3.Eagle3Config
    vocab: Any  # specjax.drafts.vocab.DraftVocab
    layout: str  # "llama" | "speculators"
    dtype: str  # the weights' dtype: "bfloat16" | "float32" | "float16"
    source_config: dict
    notes: tuple[str, ...] = ()


def _refuse(folder: str, field: str, problem: str, fix: str) -> None:
    raise ValueError(f"cannot import {folder}: {field}: {problem}. Fix: {fix}")


def read_head(folder: str, *, target_config: Optional[Mapping] = None,
              assume_aux_ids: Optional[tuple[int, ...]] = None) -> ImportedHead:
    """Read a head folder into specjax params + Eagle3Config + DraftVocab.

    Aux ids come from the head's config (nested output-of-layer ids, else top-level ids - 1); a head
    with neither was trained on the engines' default taps, computed from `target_config`
    (or taken from `assume_aux_ids`). Raises ValueError naming the field and the fix otherwise.
    """
    from specjax.drafts.eagle3 import Eagle3Config
    from specjax.drafts.vocab import DraftVocab
    from specjax.layers.rope import rope_spec_from_hf

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    config, tensors, manifest, _ = read_head_files(folder)
    layout, cfg = flatten_head_config(config)
    notes: list[str] = []

    # --- features specjax's draft does not have: importing would silently change the function
    n_layers = cfg.get("num_hidden_layers", 1)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        _refuse(folder, "num_hidden_layers", f"{n_layers!r}", "the head's config must give its decoder layer count")
    nbr = cfg.get("norm_before_residual")
    if nbr:
        _refuse(folder, "norm_before_residual", "true (the residual is the normed hidden)",
                "specjax trains norm_before_residual=false heads only (the SGLang-compatible form)")
    if nbr is None and layout == "speculators":
        notes.append("norm_before_residual absent: read as false (speculators 0.9 default; vLLM assumes true)")
    if cfg.get("norm_before_fc") or "input_norm.weight" in tensors:
        _refuse(folder, "norm_before_fc", "the head normalises the concatenated aux states (input_norm)",
                "specjax supports EAGLE-3.1 fc_norm (one norm per aux chunk), not norm_before_fc")
    for key in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(key):
            _refuse(folder, key, "the head has biases", "use a bias-free head (the Llama-EAGLE3 contract)")
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(folder, "hidden_act", repr(cfg.get("hidden_act")), "use a SiLU-gated head")
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        _refuse(folder, "eagle_config.use_aux_hidden_state", "false (no fc over aux states)",
                "use an EAGLE-3 head")

    # --- tensor names: tolerate the prefix/legacy spellings other tools write, refuse the rest
    rename: dict[str, str] = {}
    for name in tensors.names:
        new = name
        if new.startswith("model."):
            new = new[len("model."):]
        new = LEGACY_AUX_NORMS.get(new, new)
        rename[name] = new
    if any(k != v for k, v in rename.items()):
        notes.append("renamed keys: " + ", ".join(f"{k}->{v}" for k, v in rename.items() if k != v))
    by_new = {v: k for k, v in rename.items()}
    if any(n.startswith("fc_norm.") for n in by_new) and not cfg.get("fc_norm"):
        cfg["fc_norm"] = True  # legacy aux_norm_* heads predate the flag
    expected = expected_weights(cfg, key_layout(layout, by_new))
    unknown = [n for n in by_new if n not in expected and n not in weights.EAGLE3_VOCAB_TENSORS
               and n not in _IGNORED_KEYS]
    if unknown:
        _refuse(folder, unknown[0], f"unexpected tensor(s) {unknown}", "import an EAGLE-3 (Llama) head")
    missing = [n for n in expected if n not in by_new]
    if missing:
        _refuse(folder, missing[0], f"missing tensor(s) {missing}",
                "the head must hold the full key set (docs/eagle3-format.md, \"Checkpoint layout\")")
    # a specjax head trained with draft.train_embedding: its embed_tokens is its own (vLLM serves it so)
    own_embedding = bool(((manifest or {}).get("draft_config") or {}).get("train_embedding")) and EMBED_KEY in by_new
    for n in by_new:
        if n in _IGNORED_KEYS and not (own_embedding and n == EMBED_KEY):
            notes.append(f"{n} ignored (specjax uses the target's embedding / has no verifier copy)")

    # --- config
    H = int(cfg["hidden_size"])
    nH = int(cfg["num_attention_heads"])
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if nested:
        aux = tuple(int(i) for i in nested)
        if top and [i + 1 for i in aux] != [int(i) for i in top]:
            _refuse(folder, "eagle_aux_hidden_state_layer_ids", f"top-level {top} != nested {list(nested)} + 1",
                    "fix the head's config so both keys name the same layers")
    elif top:
        aux = tuple(int(i) - 1 for i in top)
    elif target_config is not None:
        aux = default_aux_layer_ids(target_virtual_depth(target_config), clamp=False)
        notes.append(f"no aux ids in the head: using the engines' default taps {list(aux)} (output convention)")
    elif assume_aux_ids is not None:
        aux = tuple(int(i) for i in assume_aux_ids)
        notes.append(f"no aux ids in the head: assuming it was trained on {list(aux)} (output convention)")
    else:
        _refuse(folder, "eagle_aux_hidden_state_layer_ids", "absent, and no target config to derive the "
                "default taps from", "pass target_config (the target's config.json dict)")
    norm_output = bool(cfg.get("norm_output", False))
    if norm_output and layout == "llama" and not (manifest and manifest.get("format") == "specjax-eagle3"):
        notes.append("norm_output: true read with the vLLM/SGLang meaning (post-norm hidden fed to the next step); "
                     "SpecForge writes it meaning 'norm before lm_head' (docs/eagle3-format.md, "
                     "\"EAGLE-3.1 flags (fc_norm, norm_output)\")")
    try:  # a draft copies its target's RoPE: YaRN (gpt-oss, DeepSeek), LongRoPE and partial (Phi-3, GLM, ...)
        rope = rope_spec_from_hf(cfg, longrope=True, partial_rotary=True, yarn=True)
    except ValueError as e:
        _refuse(folder, "rope_parameters", str(e),
                "specjax drafts support default/linear/llama3/YaRN/LongRoPE RoPE, full or partial width")
    V = int(cfg["vocab_size"])
    Vd = int(cfg.get("draft_vocab_size") or V)
    draft_cfg = Eagle3Config(
        hidden_size=H,
        target_hidden_size=int(cfg.get("target_hidden_size") or H),
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=nH,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or nH),
        head_dim=int(cfg.get("head_dim") or H // nH),
        vocab_size=V,
        draft_vocab_size=Vd,
        aux_layer_ids=aux,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        hidden_act="silu",
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=norm_output,
        num_layers=int(n_layers),
        parallel_drafting=cfg.get("mask_token_id") is not None,
        mask_token_id=None if cfg.get("mask_token_id") is None else int(cfg["mask_token_id"]),
        train_embedding=own_embedding,
    )
    try:
        draft_cfg.validate()
    except ValueError as e:
        _refuse(folder, "config", str(e), "fix the head's config.json")

    # --- weights (the table says where each file tensor goes and whether it is transposed)
    leaves = []
    dtypes = set()
    for name, e in expected.items():
        src = by_new[name]
        if tuple(tensors.shape(src)) != e.file_shape:
            _refuse(folder, src, f"shape {tensors.shape(src)} but the config implies {e.file_shape}",
                    "the head's config.json must describe its weights")
        if tensors.dtype(src) not in _ST_DTYPES:
            _refuse(folder, src, f"dtype {tensors.dtype(src)}", "weights must be bf16, fp16 or fp32")
        dtypes.add(_ST_DTYPES[tensors.dtype(src)])
        a = tensors.array(src)
        leaves.append((e.path, np.ascontiguousarray(a.T) if e.row.transpose else a))
    if own_embedding:
        src = by_new[EMBED_KEY]
        if tuple(tensors.shape(src)) != (V, H):
            _refuse(folder, src, f"shape {tensors.shape(src)}, expected ({V}, {H})", "export [vocab_size, hidden_size]")
        leaves.append((tuple(weights.EAGLE3_EMBED_PARAM.split(".")), tensors.array(src)))
    params = weights.nest(leaves)
    if len(dtypes) != 1:
        notes.append(f"mixed weight dtypes {sorted(dtypes)}")
    dtype = sorted(dtypes)[0] if len(dtypes) == 1 else "float32"

    # --- vocab
    if "d2t" in by_new:
        if tuple(tensors.shape(by_new["d2t"])) != (Vd,):  # checked on the header: nothing read yet
            _refuse(folder, "d2t", f"shape {tensors.shape(by_new['d2t'])}, expected ({Vd},)",
                    "ship d2t for draft_vocab_size")
        ids = np.arange(Vd, dtype=np.int64) + tensors.array(by_new["d2t"]).astype(np.int64)
    elif Vd == V:
        ids = np.arange(V, dtype=np.int64)
    else:
        _refuse(folder, "d2t", f"absent with draft_vocab_size {Vd} < vocab_size {V}",
                "the head must ship d2t (which target token each draft row predicts)")
    try:
        vocab = DraftVocab.from_ids(ids, V)
    except ValueError as e:
        _refuse(folder, "d2t", str(e), "rebuild the head's vocab mapping")
    if not np.array_equal(vocab.draft_ids, ids):
        _refuse(folder, "d2t", "target ids are not in ascending order", "rebuild d2t from the sorted draft ids")
    if "t2d" in by_new:
        t2d = tensors.array(by_new["t2d"]).astype(bool) if tuple(tensors.shape(by_new["t2d"])) == (V,) else None
        if t2d is None or not np.array_equal(np.flatnonzero(t2d), ids):
            _refuse(folder, "t2d", "does not match d2t (nonzero(t2d) != arange(Vd) + d2t)",
                    "rebuild both maps from the same draft ids")
    for n in notes:
        log.info("import %s: %s", folder, n)
    return ImportedHead(params=params, config=draft_cfg, vocab=vocab, layout=layout, dtype=dtype,
                        source_config=dict(config), notes=tuple(notes))


_SHAPE_FIELDS = ("hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "fc_norm", "norm_output", "num_layers",
                 "parallel_drafting", "mask_token_id")
_DRAFT_KEYS = {"intermediate_size": "draft.intermediate_size", "num_attention_heads": "draft.num_attention_heads",
               "num_key_value_heads": "draft.num_key_value_heads", "head_dim": "draft.head_dim",
               "fc_norm": "draft.fc_norm", "norm_output": "draft.norm_output", "num_layers": "draft.num_layers",
               "mask_token_id": "draft.mask_token_id", "parallel_drafting": "draft.type"}


def warm_start_params(folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
    """Params for a run that starts from a published head (`draft.init_from`).

    The head must have the run's architecture (sizes, EAGLE-3.1 flags) and aux taps; errors name the
    config key to change. When the head's draft vocab differs from the run's, lm_head rows are
    matched by target token id: shared tokens keep the head's row, the others keep `init_params`'
    fresh row. Leaves come back as jax arrays with init_params' dtypes.
    """
    head = read_head(folder, assume_aux_ids=tuple(draft_cfg.aux_layer_ids))
    hc = head.config
    diff = [f for f in _SHAPE_FIELDS if getattr(hc, f) != getattr(draft_cfg, f)]
    if diff:
        lines = "; ".join(f"{f}: head {getattr(hc, f)} vs run {getattr(draft_cfg, f)}"
                          + (f" (set {_DRAFT_KEYS[f]}={getattr(hc, f)})" if f in _DRAFT_KEYS else "")
                          for f in diff)
        raise ValueError(f"draft.init_from={folder}: the head does not fit this run's draft: {lines}. A head "
                         "for another target (hidden size / vocab) cannot be warm-started from.")
    if tuple(hc.aux_layer_ids) != tuple(draft_cfg.aux_layer_ids):
        raise ValueError(f"draft.init_from={folder}: the head was trained on aux layers {list(hc.aux_layer_ids)}, "
                         f"the run taps {list(draft_cfg.aux_layer_ids)}. Fix: set "
                         f"target.aux_layer_ids=[{','.join(map(str, hc.aux_layer_ids))}] (fc is tied to its taps).")
    if hc.rope != draft_cfg.rope or hc.rms_norm_eps != draft_cfg.rms_norm_eps:
        log.warning("draft.init_from=%s: the head's RoPE/eps (%s, %s) differ from the target's (%s, %s); "
                    "training continues with the target's", folder, hc.rope, hc.rms_norm_eps, draft_cfg.rope,
                    draft_cfg.rms_norm_eps)
    head_params = dict(head.params)
    if hc.train_embedding and not draft_cfg.train_embedding:
        raise ValueError(f"draft.init_from={folder}: the head has its own trained embedding (embed_tokens.weight) "
                         "and this run uses the target's. Fix: draft.train_embedding=true to keep training it")
    if draft_cfg.train_embedding and not hc.train_embedding:  # start the run's embedding from the target's
        head_params["embed_tokens"] = init_params["embed_tokens"]
    out = params_like(folder, head_params, head.vocab, vocab, init_params)
    log.info("warm start: draft params loaded from %s (%s layout)", folder, head.layout)
    return out

"""Export a trained specjax EAGLE-3 draft as the checkpoint vLLM and SGLang load.

Layout (shared/reference/eagle3-contract.md §2.11): one folder with
  model.safetensors     fc / midlayer.* / norm / lm_head weights (HF [out, in] = kernel.T), d2t int64
                        offsets [Vd], t2d bool [V]; no `model.` prefix and no embed_tokens (engines use
                        the target's embedding)
  config.json           a LlamaForCausalLMEagle3 config (one layer, untied head, the target's vocab,
                        RoPE and context, aux ids in both index conventions)
  specjax_manifest.json sha256 of each file plus whatever the caller adds (step, metrics, run config)

The folder is written under a temporary name next to `out_dir` and renamed at the end, so a failed
export leaves no partial folder behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Mapping, Optional

import numpy as np

__all__ = [
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "WEIGHTS_FILE",
    "eagle3_hf_config",
    "eagle3_state_dict",
    "expected_shapes",
    "export_eagle3",
    "normalize_dtype",
    "validate_export",
]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "specjax_manifest.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"
FORMAT = "specjax-eagle3"
FORMAT_VERSION = 1

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
# Target config fields copied verbatim when present (special-token ids the engines may read).
_COPIED_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_RESERVED_MANIFEST_KEYS = ("format", "format_version", "dtype", "files")


def normalize_dtype(dtype: str) -> str:
    name = str(dtype).lower()
    if name not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not supported; use one of bfloat16 (bf16) or float32 (fp32).")
    return _DTYPES[name]


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for a draft config (the §2.11 key set, weights only)."""
    H, tH, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc.weight": (H, cfg.num_aux * tH),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
    }


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for name, value in tree.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping):
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


def eagle3_state_dict(draft_params: Mapping, cfg, vocab, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """HF-named numpy tensors: `<path>.kernel` -> `<path>.weight` transposed, `<path>.scale` ->
    `<path>.weight`; weights cast to `dtype`, plus d2t (int64) and t2d (bool)."""
    np_dtype = _np_dtype(normalize_dtype(dtype))
    out: dict[str, np.ndarray] = {}
    for path, leaf in _flatten(draft_params).items():
        base, _, kind = path.rpartition(".")
        # float32 first: jax bf16 arrays and numpy ml_dtypes both convert cleanly from there.
        arr = np.asarray(leaf, dtype=np.float32)
        if kind == "kernel":
            arr = arr.T
        elif kind != "scale":
            raise ValueError(f"draft param {path!r} is neither a kernel nor a norm scale; the export "
                             "knows only the EAGLE-3 layout in docs/INTERFACES.md.")
        out[f"{base}.weight"] = np.ascontiguousarray(arr.astype(np_dtype))
    out["d2t"] = np.asarray(vocab.d2t)
    out["t2d"] = np.asarray(vocab.t2d)
    return out


def _legacy_rope_scaling(rope_parameters: dict) -> Optional[dict]:
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


def eagle3_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16") -> dict:
    """The draft's config.json (contract §2.3 / §2.11)."""
    rope_parameters = cfg.rope.to_hf()
    out_ids = [int(i) for i in cfg.aux_layer_ids]
    conf = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": int(target_hf_config["vocab_size"]),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": int(target_hf_config.get("max_position_embeddings", cfg.max_position_embeddings)),
        # Both RoPE layouts: transformers 5 reads rope_parameters, older stacks rope_theta/rope_scaling.
        "rope_theta": rope_parameters["rope_theta"],
        "rope_scaling": _legacy_rope_scaling(rope_parameters),
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": False,  # SGLang would otherwise use embed_tokens as a full-vocab head
        "attention_bias": False,
        "mlp_bias": False,
        # SGLang reads the nested ids (output-of-layer-k), vLLM the top-level ones (input-to-layer-k).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": out_ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in out_ids],
        # Engines feed the pre-norm hidden to the next draft step when these are false, which is how
        # the draft was trained (contract §2.3: `norm_output` means something else in SpecForge).
        "norm_before_residual": False,
        "norm_output": False,
        "torch_dtype": normalize_dtype(dtype),
    }
    for key in _COPIED_TOKEN_FIELDS:
        if target_hf_config.get(key) is not None:
            conf[key] = target_hf_config[key]
    return conf


def _fail(field: str, problem: str, fix: str) -> None:
    raise ValueError(f"EAGLE-3 export: {field}: {problem}. Fix: {fix}")


def validate_export(tensors: Mapping[str, np.ndarray], config: Mapping, target_hf_config: Mapping) -> None:
    """The silent-failure checks of contract §2.11 that are cheap to run before writing anything."""
    shapes = {k: tuple(v) for k, v in _shapes_from_config(config).items()}
    bad_prefix = [k for k in tensors if k.startswith(("model.", "draft_model."))]
    if bad_prefix:
        _fail("weight keys", f"{bad_prefix} carry a model./draft_model. prefix", "export the draft's own keys")
    got = set(tensors) - {"d2t", "t2d"}
    if got != set(shapes):
        _fail("weight keys", f"missing {sorted(set(shapes) - got)}, unexpected {sorted(got - set(shapes))}",
              "pass the draft params from specjax.drafts.eagle3 (layout in docs/INTERFACES.md)")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            _fail(key, f"shape {tuple(tensors[key].shape)} but the config implies {shape}",
                  "export with the Eagle3Config the params were trained with")

    V, Vd = int(config["vocab_size"]), int(config["draft_vocab_size"])
    d2t, t2d = np.asarray(tensors["d2t"]), np.asarray(tensors["t2d"])
    if d2t.dtype != np.int64 or d2t.shape != (Vd,):
        _fail("d2t", f"dtype {d2t.dtype} shape {d2t.shape}, expected int64 ({Vd},)",
              "use the run's DraftVocab (draft_vocab.npz) built for this draft_vocab_size")
    if t2d.dtype != np.bool_ or t2d.shape != (V,):
        _fail("t2d", f"dtype {t2d.dtype} shape {t2d.shape}, expected bool ({V},) (the target's vocab_size)",
              "build the DraftVocab for the target's config vocab_size")
    if not np.array_equal(np.flatnonzero(t2d), np.arange(Vd) + d2t):
        _fail("d2t/t2d", "nonzero(t2d) != arange(Vd) + d2t (engines would map draft tokens to wrong ids)",
              "rebuild the vocab with specjax.drafts.vocab.DraftVocab.from_ids")

    if int(target_hf_config.get("hidden_size", config["hidden_size"])) != int(config["hidden_size"]):
        _fail("hidden_size", f"draft {config['hidden_size']} != target {target_hf_config['hidden_size']}",
              "the draft shares the target's embedding, so its hidden_size must be the target's")
    n_layers = target_hf_config.get("num_hidden_layers")
    ids = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if n_layers is not None and not all(0 <= i < int(n_layers) for i in ids):
        _fail("aux_layer_ids", f"{ids} outside the target's {n_layers} layers", "use ids in [0, num_hidden_layers)")

    from specjax.targets.layers.rope import rope_spec_from_hf

    if rope_spec_from_hf(target_hf_config).to_hf() != config["rope_parameters"]:
        _fail("rope_parameters", f"draft {config['rope_parameters']} != target "
              f"{rope_spec_from_hf(target_hf_config).to_hf()}", "the draft must use the target's RoPE")


def _shapes_from_config(config: Mapping) -> dict[str, tuple[int, ...]]:
    from types import SimpleNamespace

    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    cfg = SimpleNamespace(
        hidden_size=config["hidden_size"], target_hidden_size=config["target_hidden_size"],
        intermediate_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
        draft_vocab_size=config["draft_vocab_size"], num_aux=n_aux,
    )
    return expected_shapes(cfg)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _apply_umask_modes(folder: str) -> None:
    """mkdtemp makes a private 0700 folder; give it (and the files) the modes a plain mkdir/open would,
    so a server running as another user can read the export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _is_replaceable(path: str) -> bool:
    """An existing out_dir may be replaced only if it is empty or an earlier export."""
    if not os.path.isdir(path):
        return False
    entries = os.listdir(path)
    return not entries or MANIFEST_FILE in entries


def export_eagle3(
    draft_params: Mapping,
    draft_cfg,
    vocab,
    target_hf_config: Mapping,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    extra_manifest: Optional[Mapping] = None,
) -> str:
    """Validate, then write model.safetensors + config.json + specjax_manifest.json to `out_dir`.

    `vocab` needs `d2t` (int64 [Vd]) and `t2d` (bool [V]) (a DraftVocab). Raises ValueError before
    touching the disk when the draft, vocab and target config disagree. An existing `out_dir` is
    replaced only when it is empty or holds an earlier export. Returns the absolute out_dir.
    """
    from safetensors.numpy import save_file

    dtype = normalize_dtype(dtype)
    extra = dict(extra_manifest or {})
    clash = [k for k in extra if k in _RESERVED_MANIFEST_KEYS]
    if clash:
        _fail("extra_manifest", f"keys {clash} are reserved", f"rename them (reserved: {_RESERVED_MANIFEST_KEYS})")
    tensors = eagle3_state_dict(draft_params, draft_cfg, vocab, dtype)
    config = eagle3_hf_config(draft_cfg, target_hf_config, dtype)
    validate_export(tensors, config, target_hf_config)

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not _is_replaceable(out_dir):
        _fail("out_dir", f"{out_dir} exists and is not an earlier specjax export",
              "choose an empty or new folder (the export will not overwrite other files)")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        files = {
            name: {"sha256": _sha256(os.path.join(tmp, name)), "bytes": os.path.getsize(os.path.join(tmp, name))}
            for name in (WEIGHTS_FILE, CONFIG_FILE)
        }
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype, "files": files, **extra}
        with open(os.path.join(tmp, MANIFEST_FILE), "w") as f:
            json.dump(manifest, f, indent=2, default=_json_default)
            f.write("\n")
        _apply_umask_modes(tmp)
        if os.path.exists(out_dir):
            # Swap: the old export is moved aside first so out_dir is never half-written.
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, "x"))
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

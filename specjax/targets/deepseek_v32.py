"""DeepSeek-V3.2 frozen targets in plain JAX: ``DeepseekV32ForCausalLM`` (DeepSeek-V3.2-Exp,
DeepSeek-V3.2) and ``GlmMoeDsaForCausalLM`` (GLM-5): DeepSeek-V3 with DeepSeek Sparse Attention.

Read top to bottom: config + HF key tables -> HF weight map -> the decoder layer and the layer
schedule -> cached decoding hooks -> Target classes.

Layout (transformers' DeepseekV32ForCausalLM): DeepSeek-V3 (``deepseek_v3.py``: MLA with a query
LoRA, a dense SwiGLU MLP in the first layers, then the sigmoid-routed MoE with shared experts), and
in every attention layer a lightning indexer (``layers/indexer.py``) that keeps, for each query, the
index_topk keys with the highest index scores among those it may see; MLA attends to those only
(its mask is the causal / cache mask AND the kept keys). The indexer's queries come from MLA's query
LoRA latent, so a query LoRA is required.

GlmMoeDsaForCausalLM is the same blocks under GLM's config defaults, with two differences: the
indexer's RoPE dims are interleaved pairs (as in MLA) where DeepSeek-V3.2 rotates them half-split,
and a layer may be "shared" (``indexer_types``; GLM-5.x's IndexShare): it has no indexer and reuses
the kept keys of the last layer before it that has one. transformers derives the per-layer kinds
from ``indexer_types``, else ``index_topk_pattern`` ("F"/"S" per layer), else
``index_topk_freq`` / ``index_skip_topk_offset`` (by default every layer has its own indexer).

Params: deepseek_v3's tree (``layers``, ``mlp_layers``, ``moe_layers``, embeddings, norm, lm_head)
plus ``indexer_layers`` [Li, ...] (wq_b, wk, k_norm scale and bias, weights_proj), stacked over the
layers that have an indexer; weights_proj stays fp32 whatever the load dtype, as in transformers.
The indexer recomputes MLA's query latent RMSNorm(h @ q_a_proj) (one [D, q_lora_rank] product per
token; mla_block does not return it). In the FP8 releases wq_b and wk are block-scaled FP8 like the
other linear weights (targets/quantized.py), weights_proj is stored in bf16.

Cached decoding: DeepSeek's latent cache {"kv", "k_rope"} [L, B, S, ...] plus the indexer's key
cache "index_k" [Li, B, S, index_head_dim], all with the slot on axis 2 (rollback and the tree
commit move them together). Cached decoding equals the forward: a query kept keys by the same
scores over the same visible keys (ties keep the lower position, which is the lower slot).

Refused with a ValueError naming the key and the fix: a config without a query LoRA, attention
biases, ``rope_interleave`` false or an ``indexer_rope_interleave`` that contradicts the architecture
(transformers ignores both and always applies the layout above), DeepSeek-V3.2 configs that ask for
shared indexer layers (transformers' DeepseekV32 ignores them: that is GLM's model), a first layer
without an indexer, an index head narrower than qk_rope_head_dim, and everything deepseek_v3 refuses
(router switches transformers does not implement, num_key_value_heads != num_attention_heads, rope
types other than default / yarn, quantizations other than block-scaled FP8).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.layers.norms import rms_norm
from specjax.layers.rope import rope_spec_from_hf
from specjax.targets import deepseek_v3 as ds
from specjax.targets.base import WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs
from specjax.targets.glm4_moe import dense_prefix
from specjax.targets.hf_keys import HFKey, hf_values, read_hf_keys
from specjax.targets.layers import indexer, mla
from specjax.targets.layers.scan import index_layer
from specjax.targets.quantized import quantize_weight_specs, weight_quant_from_hf
from specjax.targets.registry import register

ARCH = "DeepseekV32ForCausalLM"
GLM_ARCH = "GlmMoeDsaForCausalLM"
# config.json model_type of each architecture (the registry's MODEL_TYPE_TO_ARCH rows)
MODEL_TYPES = {ARCH: "deepseek_v32", GLM_ARCH: "glm_moe_dsa"}
FULL, SHARED = "full", "shared"  # transformers' indexer_types entries


def _optional_int(value):
    return None if value is None else int(value)


def _hf_keys(d: Mapping[str, Any]) -> tuple[HFKey, ...]:
    """config.json keys <-> config fields, with the defaults ``d`` of one transformers config class
    (an absent key means what it means there). first_k_dense_replace is read by :func:`_dense_layers`."""
    return (
        HFKey("vocab_size"),
        HFKey("hidden_size"),
        HFKey("intermediate_size"),
        HFKey("moe_intermediate_size"),
        HFKey("num_hidden_layers"),
        HFKey("num_attention_heads"),
        HFKey("q_lora_rank", _optional_int, d["q_lora_rank"]),
        HFKey("kv_lora_rank", int, 512),
        HFKey("qk_nope_head_dim", int, d["qk_nope_head_dim"]),
        HFKey("qk_rope_head_dim", int, 64),
        HFKey("v_head_dim", int, d["v_head_dim"]),
        HFKey("n_routed_experts", int, lambda hf: hf.get("num_local_experts") or 256),
        HFKey("num_experts_per_tok", int, 8),
        HFKey("n_shared_experts", int, 1),
        HFKey("n_group", int, d["n_group"]),
        HFKey("topk_group", int, d["topk_group"]),
        HFKey("norm_topk_prob", bool, True),
        HFKey("routed_scaling_factor", float, 2.5),
        # not a transformers field (it drops the MTP layer by name); DeepSeek's and GLM's config.json set 1
        HFKey("num_nextn_predict_layers", int, 1),
        HFKey("rms_norm_eps", float, d["rms_norm_eps"]),
        HFKey("tie_word_embeddings", bool, False),
        HFKey("max_position_embeddings", int, d["max_position_embeddings"]),
        HFKey("index_topk", int, 2048),
        HFKey("index_head_dim", int, 128),
        HFKey("index_n_heads", int, d["index_n_heads"]),
    )


# transformers' DeepseekV32Config and GlmMoeDsaConfig defaults where they differ
HF_KEYS = {
    ARCH: _hf_keys(dict(q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4,
                        rms_norm_eps=1e-6, max_position_embeddings=163840, index_n_heads=64)),
    GLM_ARCH: _hf_keys(dict(q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1,
                            rms_norm_eps=1e-5, max_position_embeddings=202752, index_n_heads=32)),
}
DEFAULT_DENSE_LAYERS = 3  # transformers: first_k_dense_replace's default (capped at num_hidden_layers)
# the indexer's RoPE layout transformers applies per architecture (config.json's key is not read)
INDEXER_ROPE_INTERLEAVE = {ARCH: False, GLM_ARCH: True}
INDEX_LIMITS = {"index_n_heads": 4096, "index_head_dim": 8192}  # the sanity bounds of heads / head_dim


# =============================================================================================
# Config
# =============================================================================================
def _dense_layers(hf: Mapping[str, Any], arch: str) -> int:
    """How many leading layers are dense: mlp_layer_types when given (glm4_moe.dense_prefix: dense
    layers first, agreeing with first_k_dense_replace), else first_k_dense_replace (default 3),
    capped at num_hidden_layers as transformers does."""
    if hf.get("mlp_layer_types") is not None:
        return dense_prefix(hf, arch)
    k = hf.get("first_k_dense_replace")
    return min(DEFAULT_DENSE_LAYERS if k is None else int(k), int(hf["num_hidden_layers"]))


def indexer_kinds(hf: Mapping[str, Any], n: int) -> list:
    """Per layer "full" (own indexer) or "shared", as transformers' GlmMoeDsaConfig derives them:
    indexer_types, else index_topk_pattern ("F"/"S" per layer, or a list), else every
    index_topk_freq-th layer from index_skip_topk_offset - 1 on (defaults 1 and 2: every layer)."""
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": FULL, "S": SHARED}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(hf.get("index_topk_freq") or 1), 1)
    offset = hf.get("index_skip_topk_offset")
    offset = 2 if offset is None else int(offset)
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n)]


def _check_layouts(hf: Mapping[str, Any], arch: str) -> None:
    """The keys transformers ignores because the architecture fixes their meaning: refused when they
    say something else."""
    if hf.get("rope_interleave", True) is not True:
        raise ValueError(f"{arch} with rope_interleave={hf['rope_interleave']!r}: transformers' {arch} always "
                         "rotates MLA's RoPE dims as interleaved pairs and ignores the key. Fix: drop rope_interleave "
                         "from config.json (or set it to true)")
    want = INDEXER_ROPE_INTERLEAVE[arch]
    if hf.get("indexer_rope_interleave", want) != want:
        other = GLM_ARCH if arch == ARCH else ARCH
        raise ValueError(
            f"{arch} with indexer_rope_interleave={hf['indexer_rope_interleave']!r}: transformers' {arch} rotates "
            f"the indexer's RoPE dims {'as interleaved pairs' if want else 'half-split'} and ignores the key; "
            f"the other layout is {other}'s. Fix: set architectures to [\"{other}\"] if the checkpoint was "
            f"trained with that layout, else drop indexer_rope_interleave")
    if arch == ARCH:
        asks = {k: hf[k] for k in ("indexer_types", "index_topk_pattern", "index_topk_freq") if hf.get(k) is not None}
        if SHARED in indexer_kinds(hf, int(hf["num_hidden_layers"])):
            raise ValueError(
                f"{arch} with {asks}: that makes some layers reuse another layer's top-k (shared indexer layers), "
                f"which transformers' {arch} ignores (every layer runs its own indexer) and {GLM_ARCH} implements. "
                f"Fix: set architectures to [\"{GLM_ARCH}\"] for a checkpoint with shared layers, else drop "
                f"{sorted(asks)}")


@dataclasses.dataclass(frozen=True)
class DeepseekV32TargetConfig(ds.DeepseekV3TargetConfig):
    """DeepSeek-V3's config (every field and property) plus the lightning indexer's fields."""

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    shared_indexer_layers: tuple[int, ...] = ()  # GLM-5.x: layers that reuse the previous indexer's choice

    @property
    def indexer(self) -> indexer.IndexerConfig:
        return indexer.IndexerConfig(
            num_heads=self.index_n_heads, head_dim=self.index_head_dim, rope_dim=self.qk_rope_head_dim,
            topk=self.index_topk, rope_interleave=INDEXER_ROPE_INTERLEAVE[self.architecture],
            q_block=self.kernels.target_attention_q_block)

    @property
    def indexer_layer_ids(self) -> tuple[int, ...]:
        """The layers that run their own indexer (rows of ``indexer_layers`` and of the key cache)."""
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.shared_indexer_layers)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "DeepseekV32TargetConfig":
        hf, arch = resolve_hf_config(hf, tuple(MODEL_TYPES), "DeepseekV32TargetConfig", silu_keys=("hidden_act",))
        for key, want in ds.FIXED_KEYS.items():
            if hf.get(key, want) != want:
                raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported: transformers' {arch} always routes "
                                 f"as {key}={want!r}. Fix: set {key} to {want!r} or drop it from config.json")
        if hf.get("attention_bias"):
            raise ValueError(f"{arch} with attention_bias=true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj) is "
                             "not supported by specjax targets. Fix: a checkpoint without them (the published "
                             "DeepSeek-V3.2 and GLM-5 have none)")
        heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if kv_heads not in (None, heads):
            raise ValueError(f"{arch}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                             "(latent attention expands the shared latent into every head)")
        if "q_lora_rank" in hf and hf["q_lora_rank"] is None:  # null would read as the default below
            raise ValueError(f"{arch} with q_lora_rank=null (a plain q_proj) is not supported: the indexer's queries "
                             "are projected from MLA's query LoRA latent, and transformers' attention always has one. "
                             "Fix: set q_lora_rank (DeepSeek-V3.2: 1536, GLM-5: 2048)")
        _check_layouts(hf, arch)
        rope = rope_spec_from_hf(hf, yarn=True)
        if rope.rope_type not in ds.ROPE_TYPES:
            raise ValueError(f"{arch} with rope type {rope.rope_type!r} is not supported (only {ds.ROPE_TYPES})")
        n = int(hf["num_hidden_layers"])
        kinds = indexer_kinds(hf, n) if arch == GLM_ARCH else [FULL] * n
        if len(kinds) != n or not set(kinds) <= {FULL, SHARED}:
            raise ValueError(f"{arch}: indexer_types must list '{FULL}' or '{SHARED}' for each of the "
                             f"num_hidden_layers={n} layers, got {kinds!r}")
        kw = dict(architecture=arch, rope=rope, first_k_dense_replace=_dense_layers(hf, arch),
                  shared_indexer_layers=tuple(i for i, k in enumerate(kinds) if k == SHARED),
                  weight_quant=weight_quant_from_hf(hf, arch), **read_hf_keys(HF_KEYS[arch], hf))
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """deepseek_v3's checks, then the query LoRA and the indexer's shape (ValueError naming the key)."""
        super().validate()
        arch = self.architecture
        if self.q_lora_rank is None:
            raise ValueError(f"{arch} needs q_lora_rank: the indexer's queries are projected from MLA's query LoRA "
                             "latent, and transformers' attention always has one. Fix: set q_lora_rank (DeepSeek-V3.2: "
                             "1536, GLM-5: 2048)")
        bad = [f"{k}={getattr(self, k)}" for k in ("index_topk", "index_n_heads", "index_head_dim")
               if not 1 <= getattr(self, k) <= INDEX_LIMITS.get(k, 2**27)]
        if bad:
            raise ValueError(f"{arch}: {', '.join(bad)} out of range (index_topk >= 1, index_n_heads in 1..4096, "
                             "index_head_dim in 1..8192)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"{arch}: index_head_dim={self.index_head_dim} is narrower than qk_rope_head_dim="
                             f"{self.qk_rope_head_dim}; the indexer rotates the first qk_rope_head_dim dims of each "
                             "index head. Fix: index_head_dim >= qk_rope_head_dim")
        shared = self.shared_indexer_layers
        if any(not 0 <= i < self.num_hidden_layers for i in shared) or list(shared) != sorted(set(shared)):
            raise ValueError(f"{arch}: shared_indexer_layers={shared} must be distinct increasing layer ids below "
                             f"num_hidden_layers={self.num_hidden_layers}")
        if 0 in shared:
            raise ValueError(f"{arch}: layer 0 is '{SHARED}' (indexer_types), but a shared layer reuses the top-k of "
                             f"an earlier layer with its own indexer and there is none (transformers fails at the "
                             f"first forward). Fix: make layer 0 '{FULL}'")
        if shared and arch != GLM_ARCH:
            raise ValueError(f"{arch}: shared indexer layers are {GLM_ARCH}'s; transformers' {arch} runs the "
                             "indexer in every layer. Fix: shared_indexer_layers=()")

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        out = {"architectures": [self.architecture], "model_type": MODEL_TYPES[self.architecture], "dtype": dtype,
               **hf_values(HF_KEYS[self.architecture], self), "first_k_dense_replace": self.first_k_dense_replace,
               "rope_parameters": self.rope.to_hf(), "hidden_act": "silu", "attention_bias": False,
               "num_key_value_heads": self.num_attention_heads}
        if self.architecture == GLM_ARCH:
            out["indexer_types"] = [SHARED if i in self.shared_indexer_layers else FULL
                                    for i in range(self.num_hidden_layers)]
        if self.weight_quant:
            out["quantization_config"] = self.weight_quant.to_hf()
        return out


# =============================================================================================
# HF weight map: deepseek_v3's rows, then the indexer's over the layers that have one
# =============================================================================================
def weight_specs(cfg: DeepseekV32TargetConfig) -> list[WeightSpec]:
    ids = cfg.indexer_layer_ids
    Li, D, Q, H, d = len(ids), cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    p, a = "model.layers.{i}.self_attn.indexer.", ("indexer_layers",)
    rows = [
        # hf name                   specjax path                      T?     shape           logical axes              dtype
        (p + "wq_b.weight",         a + ("wq_b", "kernel"),           True,  (Li, Q, H * d), ("layers", None, None),   None),
        (p + "wk.weight",           a + ("wk", "kernel"),             True,  (Li, D, d),     ("layers", "embed", None), None),
        (p + "k_norm.weight",       a + ("k_norm", "scale"),          False, (Li, d),        ("layers", "norm"),       None),
        (p + "k_norm.bias",         a + ("k_norm", "bias"),           False, (Li, d),        ("layers", "norm"),       None),
        # transformers keeps weights_proj fp32 in any model dtype (_keep_in_fp32_modules)
        (p + "weights_proj.weight", a + ("weights_proj", "kernel"),   True,  (Li, D, H),     ("layers", "embed", None), "float32"),
    ]
    specs = [WeightSpec(name, path, t, shape, axes, layer_ids=ids, dtype=dtype)
             for name, path, t, shape, axes, dtype in rows]
    return ds.weight_specs(cfg) + quantize_weight_specs(specs, cfg.weight_quant)


# =============================================================================================
# The decoder layer and the layer schedule
# =============================================================================================
def _indexer_rows(cfg: DeepseekV32TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """(has its own indexer [L] bool, the indexer row each layer uses [L]: its own, or the last one
    before it for a shared layer)."""
    full = np.array([i not in cfg.shared_indexer_layers for i in range(cfg.num_hidden_layers)])
    return full, (np.cumsum(full) - 1).astype(np.int32)


def run_layers(params: dict, cfg: DeepseekV32TargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """deepseek_v3's schedule (dense layers, then MoE layers) around the sparse-attention layer:
    x + MLA(norm(x)) under the mask AND the indexer's kept keys, then + ffn(norm(x)).

    With shared layers (GLM) the carry also holds the last kept-key mask, which a shared layer
    reuses; every layer sees the same causal / cache mask, so the carried mask applies as it is."""
    x, cache = carry
    spec = cfg.indexer
    decoding = cache is not None
    num_keys = cache["kv"].shape[2] if decoding else x.shape[1]
    active = num_keys > spec.topk  # otherwise every query keeps every key it sees
    carried = bool(cfg.shared_indexer_layers) and active
    full, rows = _indexer_rows(cfg)
    # a training forward with the indexer active runs MLA under a dense bool mask, which the flash
    # kernels do not take: the plain path then, at the unpadded head width (mla.attention_width)
    mla_spec = dataclasses.replace(cfg.mla, implementation="plain") if active and not decoding else cfg.mla

    def kept(h, lp_attn, row, cache):
        """This layer's own indexer: (attention mask, cache)."""
        ip = index_layer(params["indexer_layers"], row)
        q_latent = indexer.query_latent(lp_attn, h)
        if not decoding:
            return indexer.forward_mask(ip, spec, h, q_latent, inputs.rope, inputs.mask), cache
        mask, keys = indexer.decode_mask(ip, spec, h, q_latent, inputs.rope, inputs.mask, cache["index_k"], row,
                                         inputs.slots)
        return mask, {**cache, "index_k": keys}

    def layer(lp, cfg, x_btd, inputs, ffn, state, i):
        cache, last = (state["cache"], state["kept"]) if carried else (state, None)
        h = rms_norm(x_btd, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)
        row = jnp.asarray(rows)[i]
        if not active:
            mask = inputs.mask
        elif carried:
            mask, cache = jax.lax.cond(jnp.asarray(full)[i], lambda c: kept(h, lp["self_attn"], row, c),
                                       lambda c: (last, c), cache)
        else:
            mask, cache = kept(h, lp["self_attn"], row, cache)
        o, cache = mla.mla_block(lp["self_attn"], mla_spec, h, mask, inputs.rope, cache=cache, layer=i,
                                 slots_bt=inputs.slots)
        x_btd = x_btd + o
        h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
        return x_btd + ffn(h), ({"cache": cache, "kept": mask} if carried else cache)

    if not carried:
        return ds.dense_then_moe_layers(params, cfg, carry, inputs, aux_ids, layer)
    # layer 0 has its own indexer (validate), so the initial value is never used
    state = {"cache": cache, "kept": jnp.asarray(inputs.mask, bool)}
    (x, state), aux = ds.dense_then_moe_layers(params, cfg, (x, state), inputs, aux_ids, layer)
    return (x, state["cache"]), aux


# =============================================================================================
# Cached decoding: the latent cache plus the indexer's key cache
# =============================================================================================
def init_cache(cfg: DeepseekV32TargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed {"kv": [L, B, S, kv_lora_rank], "k_rope": [L, B, S, qk_rope_head_dim],
    "index_k": [Li, B, S, index_head_dim]} (Li: the layers with their own indexer)."""
    return {**ds.init_cache(cfg, batch_size, max_len, dtype),
            "index_k": indexer.init_cache(len(cfg.indexer_layer_ids), batch_size, max_len, cfg.indexer, dtype)}


# the forward and decode inputs are DeepSeek-V3's (segment-causal mask / bool cache mask, YaRN tables)
DECODER = Decoder(run_layers, forward_inputs=ds.forward_inputs, decode_inputs=ds.decode_inputs, init_cache=init_cache)


# =============================================================================================
# Target wrappers
# =============================================================================================
@register(ARCH)  # DeepSeek-V3 + the lightning indexer's top-k sparse attention
class DeepseekV32Target(ds.DeepseekV3Target):
    """Frozen DeepSeek-V3.2 / V3.2-Exp target: DeepSeek-V3's target (MTP-layer rule, routed-experts
    path) with the indexer in every layer."""

    config_class = DeepseekV32TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)


@register(GLM_ARCH)  # the same blocks under GLM's config: interleaved indexer RoPE, shared indexer layers
class GlmMoeDsaTarget(DeepseekV32Target):
    """Frozen GLM-5 target (see module docstring)."""

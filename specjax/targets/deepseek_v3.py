"""DeepSeek-V3 frozen target (``DeepseekV3ForCausalLM``; Kimi K2's text model is the same
architecture under another config) in plain JAX.

Read top to bottom: config + HF key table -> HF weight map -> blocks (the decoder layer, the MoE
feed-forward) -> layer schedule -> cached decoding hooks -> Target class (the skeleton around the
layers: decoder.py).

Layout (transformers' DeepseekV3ForCausalLM): every layer is pre-norm multi-head latent attention
(``layers/mla.py``: query LoRA, compressed KV latent + one shared RoPE key, YaRN RoPE on
interleaved pairs) followed by a pre-norm feed-forward, which is
  * a dense SwiGLU MLP of width ``intermediate_size`` in layers 0 .. first_k_dense_replace - 1;
  * an MoE block in every later layer: DeepSeek's sigmoid router (``layers/routers.sigmoid_topk``:
    e_score_correction_bias steers the choice only, group-limited top-k over n_group groups,
    norm_topk_prob, routed_scaling_factor) over n_routed_experts SwiGLU experts of width
    moe_intermediate_size (``specjax_kernels.moe``), plus n_shared_experts shared experts that every
    token uses, held as one SwiGLU MLP of width moe_intermediate_size * n_shared_experts.

Params: attention and norms of all L layers are stacked under ``layers``; the dense MLPs under
``mlp_layers`` [Ld, ...]; the MoE layers' router, experts and shared experts under ``moe_layers``
([Lm, ...], experts [Lm, E, ...]). The schedule is static: dense layers first, then MoE layers, so
each span between aux taps is at most two scans, one per kind (no per-layer switch). The router's
weight and correction bias stay fp32 whatever the load dtype (transformers keeps them fp32 too; a
bf16-rounded router flips expert choices).

On disk: one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ...), as DeepSeek publishes
them and transformers 5 writes them. The published checkpoints also carry the multi-token-prediction
module as layers num_hidden_layers .. + num_nextn_predict_layers - 1 (``model.layers.61.*``); like
transformers, the target ignores them. FP8 releases (block-scaled ``weight_scale_inv``) load as
published and stay FP8 on the device, dequantized one layer at a time (targets/quantized.py).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from specjax_kernels.moe import moe_experts

from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, rope_spec_from_hf, rope_tables, yarn_softmax_scale_factor
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, swiglu, tap_split
from specjax.targets.hf_keys import HFKey, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import mla
from specjax.targets.layers.attention import cache_attention_mask, segment_causal_mask
from specjax.targets.layers.routers import check_grouped_topk, router_logits, sigmoid_topk
from specjax.targets.layers.scan import index_layer, layer_scan
from specjax.targets.quantized import Fp8BlockQuant, quantize_weight_specs, weight_quant_from_hf
from specjax.targets.registry import model_type_of, register

ARCH = "DeepseekV3ForCausalLM"


def _optional_int(value):
    return None if value is None else int(value)


# config.json keys <-> config fields. A key may be absent only where transformers' DeepseekV3Config
# has a default; the default here is that one (so an absent key means what it means there).
HF_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("intermediate_size"),
    HFKey("moe_intermediate_size"),
    HFKey("num_hidden_layers"),
    HFKey("num_attention_heads"),
    HFKey("q_lora_rank", _optional_int, None),  # null: a plain q_proj (from_hf requires the key)
    HFKey("kv_lora_rank"),
    HFKey("qk_nope_head_dim"),
    HFKey("qk_rope_head_dim"),
    HFKey("v_head_dim"),
    HFKey("n_routed_experts", default=lambda hf: hf["num_local_experts"]),
    HFKey("num_experts_per_tok"),
    HFKey("n_shared_experts", int, 1),
    HFKey("n_group", int, 8),
    HFKey("topk_group", int, 4),
    HFKey("first_k_dense_replace", int, 3),
    HFKey("norm_topk_prob", bool, True),
    HFKey("routed_scaling_factor", float, 2.5),
    HFKey("rope_interleave", bool, True),
    HFKey("num_nextn_predict_layers", int, 1),
    HFKey("rms_norm_eps", float, 1e-6),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("max_position_embeddings", int, 4096),
)
# keys of the published configs that transformers ignores; any other value changes the model
FIXED_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
ROPE_TYPES = ("default", "yarn")
# transformers keeps the router weight and its correction bias in fp32 inside a bf16 model
ROUTER_DTYPE = "float32"


# =============================================================================================
# Config
# =============================================================================================
class DenseThenMoeFields:
    """What DeepSeek-V3's feed-forward schedule reads from a config with its field names
    (n_routed_experts, n_shared_experts, moe_intermediate_size, first_k_dense_replace): shared by
    every config that uses :func:`feedforward_weight_specs` and :func:`dense_then_moe_layers`."""

    @property
    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe(self, layer: int) -> bool:
        """transformers' rule: layers from first_k_dense_replace on have the MoE feed-forward."""
        return layer >= self.first_k_dense_replace

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

    @property
    def mlp_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe(i))


@dataclasses.dataclass(frozen=True)
class DeepseekV3TargetConfig(DenseThenMoeFields):
    """Hashable subset of the HF DeepseekV3Config that the forward needs (plus runtime knobs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each routed expert (and each shared one)
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 1  # MTP layers on disk after the decoder layers (ignored)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope: RopeSpec = RopeSpec()
    weight_quant: Fp8BlockQuant | None = None  # an FP8 release's block-scaled weights (targets/quantized.py)
    kernels: KernelChoices = KernelChoices()  # runtime option (moe: the routed experts' kernel)

    # what draft heads and shape reports read from a target config: transformers' DeepseekV3Config
    # sets head_dim = qk_rope_head_dim, and MLA has no separate KV heads
    @property
    def head_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla(self) -> mla.MLAConfig:
        return mla.MLAConfig(
            num_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, softmax_scale=self.qk_head_dim**-0.5 * yarn_softmax_scale_factor(self.rope),
            rope_interleave=self.rope_interleave, q_block=self.kernels.target_attention_q_block,
            implementation=self.kernels.target_attention)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "DeepseekV3TargetConfig":
        hf, arch = resolve_hf_config(hf, (ARCH,), "DeepseekV3TargetConfig", unsupported_flags=("attention_bias",),
                                     silu_keys=("hidden_act",))
        for key, want in FIXED_KEYS.items():
            if hf.get(key, want) != want:
                raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported (transformers' DeepseekV3 "
                                 f"implements {key}={want!r} only)")
        if hf.get("n_routed_experts", hf.get("num_local_experts")) is None:
            raise ValueError(f"{arch} config has neither n_routed_experts nor num_local_experts")
        if "q_lora_rank" not in hf:
            raise ValueError(f"{arch} config.json has no q_lora_rank: set it (null for a plain q_proj, as in "
                             "DeepSeek-V2-Lite; DeepSeek-V3 has 1536)")
        heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if kv_heads not in (None, heads):
            raise ValueError(f"{arch}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                             "(latent attention expands the shared latent into every head)")
        rope = rope_spec_from_hf(hf, yarn=True)
        if rope.rope_type not in ROPE_TYPES:
            raise ValueError(f"{arch} with rope type {rope.rope_type!r} is not supported (only {ROPE_TYPES})")
        kw = dict(architecture=arch, rope=rope, weight_quant=weight_quant_from_hf(hf, arch), **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ValueError naming the config key when the shapes or the routing cannot work."""
        sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
                 "n_routed_experts", "n_shared_experts", "num_experts_per_tok")
        bad = [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < (0 if k == "n_shared_experts" else 1)]
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            bad.append(f"q_lora_rank={self.q_lora_rank}")
        if bad:
            raise ValueError(f"{self.architecture}: {', '.join(bad)} must be >= 1 (n_shared_experts >= 0)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{self.architecture}: qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE pairs)")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"{self.architecture}: first_k_dense_replace={self.first_k_dense_replace} must be in "
                             f"0..num_hidden_layers={self.num_hidden_layers}")
        if self.moe_layer_ids:
            check_grouped_topk(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                               self.architecture)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        return {"architectures": [self.architecture], "model_type": model_type_of(self.architecture), "dtype": dtype,
                **hf_values(HF_KEYS, self), "rope_parameters": self.rope.to_hf(), "hidden_act": "silu",
                "attention_bias": False, "num_key_value_heads": self.num_attention_heads,
                **({"quantization_config": self.weight_quant.to_hf()} if self.weight_quant else {})}


# =============================================================================================
# HF weight map. "{i}" rows are stacked on a leading layer axis (over `layer_ids` where given);
# "{e}" rows also stack experts on a second axis. transpose=True: HF [out, in] <-> kernel [in, out].
# =============================================================================================
def weight_specs(cfg: DeepseekV3TargetConfig) -> list[WeightSpec]:
    """MLA attention rows, then :func:`feedforward_weight_specs`; FP8 releases: targets/quantized.py."""
    L, D, N = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    Q, R, Dr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_out, kv_out, o_in = N * cfg.qk_head_dim, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), N * cfg.v_head_dim
    p, a = "model.layers.{i}.", ("layers", "self_attn")
    rows = [
        # hf name                                       specjax path                                      T?     shape            logical axes
        (p + "input_layernorm.weight",                  ("layers", "input_layernorm", "scale"),           False, (L, D),          ("layers", "norm")),
        (p + "self_attn.q_proj.weight",                 a + ("q_proj", "kernel"),                         True,  (L, D, q_out),   ("layers", "embed", "heads")),
        (p + "self_attn.q_a_proj.weight",               a + ("q_a_proj", "kernel"),                       True,  (L, D, Q),       ("layers", "embed", None)),
        (p + "self_attn.q_a_layernorm.weight",          a + ("q_a_layernorm", "scale"),                   False, (L, Q),          ("layers", "norm")),
        (p + "self_attn.q_b_proj.weight",               a + ("q_b_proj", "kernel"),                       True,  (L, Q, q_out),   ("layers", None, "heads")),
        (p + "self_attn.kv_a_proj_with_mqa.weight",     a + ("kv_a_proj_with_mqa", "kernel"),             True,  (L, D, R + Dr),  ("layers", "embed", None)),
        (p + "self_attn.kv_a_layernorm.weight",         a + ("kv_a_layernorm", "scale"),                  False, (L, R),          ("layers", "norm")),
        (p + "self_attn.kv_b_proj.weight",              a + ("kv_b_proj", "kernel"),                      True,  (L, R, kv_out),  ("layers", None, "heads")),
        (p + "self_attn.o_proj.weight",                 a + ("o_proj", "kernel"),                         True,  (L, o_in, D),    ("layers", "heads", "embed")),
        (p + "post_attention_layernorm.weight",         ("layers", "post_attention_layernorm", "scale"),  False, (L, D),          ("layers", "norm")),
    ]
    specs = []
    for hf_name, path, transpose, shape, axes in rows:
        if (path[-2] == "q_proj") != (Q is None) and path[-2] in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj"):
            continue  # the query LoRA (q_a_proj, q_a_layernorm, q_b_proj) or the plain q_proj, not both
        specs.append(WeightSpec(hf_name, path, transpose, shape, axes))
    return quantize_weight_specs(specs + feedforward_weight_specs(cfg), cfg.weight_quant)


def feedforward_weight_specs(cfg) -> list[WeightSpec]:
    """The rows besides the attention: embedding, dense MLPs (layers 0 .. first_k_dense_replace - 1),
    MoE layers (router fp32: ROUTER_DTYPE; routed and shared experts), final norm, lm_head. ``cfg``:
    any config with DeepSeek-V3's feed-forward fields (GLM-4 MoE's too)."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    E, F, Fs, I = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.intermediate_size
    Lm, Ld = len(cfg.moe_layer_ids), len(cfg.mlp_layer_ids)
    p = "model.layers.{i}."
    rows = [
        # hf name                                       specjax path                                      T?     shape            logical axes
        ("model.embed_tokens.weight",                   ("embed_tokens", "embedding"),                    False, (V, D),          ("vocab", "embed")),
        (p + "mlp.gate_proj.weight",                    ("mlp_layers", "gate_proj", "kernel"),            True,  (Ld, D, I),      ("layers", "embed", "mlp")),
        (p + "mlp.up_proj.weight",                      ("mlp_layers", "up_proj", "kernel"),              True,  (Ld, D, I),      ("layers", "embed", "mlp")),
        (p + "mlp.down_proj.weight",                    ("mlp_layers", "down_proj", "kernel"),            True,  (Ld, I, D),      ("layers", "mlp", "embed")),
        (p + "mlp.gate.weight",                         ("moe_layers", "router", "kernel"),               True,  (Lm, D, E),      ("layers", "embed", None)),
        (p + "mlp.gate.e_score_correction_bias",        ("moe_layers", "router", "e_score_correction_bias"), False, (Lm, E),      ("layers", None)),
        (p + "mlp.experts.{e}.gate_proj.weight",        ("moe_layers", "experts", "gate_proj", "kernel"), True,  (Lm, E, D, F),   ("layers", "experts", "embed", "expert_mlp")),
        (p + "mlp.experts.{e}.up_proj.weight",          ("moe_layers", "experts", "up_proj", "kernel"),   True,  (Lm, E, D, F),   ("layers", "experts", "embed", "expert_mlp")),
        (p + "mlp.experts.{e}.down_proj.weight",        ("moe_layers", "experts", "down_proj", "kernel"), True,  (Lm, E, F, D),   ("layers", "experts", "expert_mlp", "embed")),
        (p + "mlp.shared_experts.gate_proj.weight",     ("moe_layers", "shared_experts", "gate_proj", "kernel"), True, (Lm, D, Fs), ("layers", "embed", "mlp")),
        (p + "mlp.shared_experts.up_proj.weight",       ("moe_layers", "shared_experts", "up_proj", "kernel"),   True, (Lm, D, Fs), ("layers", "embed", "mlp")),
        (p + "mlp.shared_experts.down_proj.weight",     ("moe_layers", "shared_experts", "down_proj", "kernel"), True, (Lm, Fs, D), ("layers", "mlp", "embed")),
        ("model.norm.weight",                           ("norm", "scale"),                                False, (D,),            ("norm",)),
        ("lm_head.weight",                              ("lm_head", "kernel"),                            True,  (D, V),          ("embed", "vocab")),
    ]
    specs = []
    for hf_name, path, transpose, shape, axes in rows:
        layer_ids = {"moe_layers": cfg.moe_layer_ids, "mlp_layers": cfg.mlp_layer_ids}.get(path[0])
        if layer_ids is not None and not layer_ids:
            continue  # no dense layers (first_k_dense_replace = 0) or no MoE layers
        if path[1:2] == ("shared_experts",) and Fs == 0:
            continue  # n_shared_experts = 0
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue
        extra = {"dtype": ROUTER_DTYPE} if path[:2] == ("moe_layers", "router") else {}
        specs.append(WeightSpec(hf_name, path, transpose, shape, axes, layer_ids=layer_ids, **extra))
    return specs


# =============================================================================================
# Blocks: the decoder layer and the MoE feed-forward (dense: decoder.swiglu; attention: layers/mla.py)
# =============================================================================================
def decoder_layer(lp: dict, cfg: DeepseekV3TargetConfig, x_btd, inputs: StackInputs, ffn, cache=None, layer=None):
    """x + MLA(norm(x)), then + ffn(norm(x)): (new x, new cache or None)."""
    h = rms_norm(x_btd, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)
    o, cache = mla.mla_block(lp["self_attn"], cfg.mla, h, inputs.mask, inputs.rope, cache=cache, layer=layer,
                             slots_bt=inputs.slots)
    x_btd = x_btd + o
    h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
    return x_btd + ffn(h), cache


def route(mp: dict, cfg: DeepseekV3TargetConfig, x_td):
    """DeepSeek-V3's router on tokens [T, D]: (expert ids int32 [T, k], fp32 weights [T, k])."""
    router = mp["router"]
    return sigmoid_topk(router_logits(x_td, router["kernel"]), cfg.num_experts_per_tok,
                        correction_bias=router["e_score_correction_bias"], n_group=cfg.n_group,
                        topk_group=cfg.topk_group, renormalize=cfg.norm_topk_prob,
                        scaling_factor=cfg.routed_scaling_factor)


def moe_ffn(mp: dict, cfg, router=None):
    """The MoE feed-forward of one layer's params (router, experts, shared_experts), as h -> out;
    ``router(mp, cfg, x_td) -> (ids, weights)`` defaults to DeepSeek-V3's :func:`route`."""
    router = router or route

    def ffn(h_btd):
        b, t, d = h_btd.shape
        x = h_btd.reshape(b * t, d)
        ids, weights = router(mp, cfg, x)
        ex = mp["experts"]
        routed = moe_experts(x, ids, weights, up_edf=ex["up_proj"]["kernel"], down_efd=ex["down_proj"]["kernel"],
                             gate_edf=ex["gate_proj"]["kernel"], activation="silu", implementation=cfg.kernels.moe)
        routed = routed.reshape(b, t, d)
        return routed if cfg.n_shared_experts == 0 else routed + swiglu(mp["shared_experts"])(h_btd)

    return ffn


# =============================================================================================
# Layer schedule: dense layers, then MoE layers; layer i uses cache row i
# =============================================================================================
def dense_then_moe_layers(params: dict, cfg, carry, inputs: StackInputs, aux_ids: Sequence[int], layer,
                          router=None) -> Any:
    """Every decoder layer, split at the aux taps; within a span one lax.scan over its dense layers
    and one over its MoE layers (the dense layers all come first, so no per-layer switch).
    ``layer(lp, cfg, x, inputs, ffn, cache, i) -> (x, cache)`` is one decoder layer around a given
    feed-forward (DeepSeek-V3's MLA layer, GLM-4's GQA one); layer i uses cache row i. ``router``:
    the MoE layers' router (:func:`moe_ffn`; default DeepSeek-V3's sigmoid one)."""
    k = cfg.first_k_dense_replace

    def scan_kind(carry, lo: int, hi: int, moe: bool):
        def step(carry, xs):
            (x, cache), (i, slot) = carry, xs
            ffn = (moe_ffn(index_layer(params["moe_layers"], slot), cfg, router) if moe
                   else swiglu(index_layer(params["mlp_layers"], slot)))
            return layer(index_layer(params["layers"], i), cfg, x, inputs, ffn, cache, i)

        ids = np.arange(lo, hi, dtype=np.int32)
        return layer_scan(step, carry, (ids, ids - (k if moe else 0)))

    def run_span(carry, a, b):
        if a < min(b, k):
            carry = scan_kind(carry, a, min(b, k), moe=False)
        if max(a, k) < b:
            carry = scan_kind(carry, max(a, k), b, moe=True)
        return carry

    return tap_split(run_span, carry, cfg.num_hidden_layers, aux_ids)


def run_layers(params: dict, cfg: DeepseekV3TargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """DeepSeek-V3's stack: :func:`dense_then_moe_layers` of :func:`decoder_layer`."""
    return dense_then_moe_layers(params, cfg, carry, inputs, aux_ids, decoder_layer)


# =============================================================================================
# Per-call inputs and the latent cache (the Decoder hooks where MLA differs from Llama)
# =============================================================================================
def forward_inputs(cfg: DeepseekV3TargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    """The training forward's segment-causal mask and RoPE tables (positions default to arange,
    segments to one): YaRN's tables over the qk_rope_head_dim dims, with their cos/sin factor."""
    b, t = input_ids_bt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    return StackInputs(segment_causal_mask(segment_ids), rope_tables(cfg.rope, cfg.qk_rope_head_dim, positions, dtype))


def decode_inputs(cfg: DeepseekV3TargetConfig, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                  valid_from_b, logits_index, dtype):
    """A chunk's bool [B,T,S] cache mask, write slots and RoPE (the contract of
    Decoder.decode_chunk and layers/attention.py "KV cache"): (StackInputs, cache unchanged)."""
    b, t = input_ids_bt.shape
    start_b = jnp.asarray(start_b, jnp.int32).reshape(b)
    if chunk_mask_btt is None:
        chunk_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    mask = cache_attention_mask(start_b, cache["kv"].shape[2], chunk_mask_btt, valid_from_b)
    slots = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    rope = rope_tables(cfg.rope, cfg.qk_rope_head_dim, positions_bt, dtype)
    return StackInputs(mask, rope, slots=slots), cache


def init_cache(cfg: DeepseekV3TargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed latent cache {"kv": [L, B, S, kv_lora_rank], "k_rope": [L, B, S, qk_rope_head_dim]}."""
    return mla.init_cache(cfg.num_hidden_layers, batch_size, max_len, cfg.mla, dtype)


# Cached decoding: the absorbed form over the latent cache (layers/mla.py); the feed-forwards are per
# token (the router sees each token alone, so a chunk routes as the full sequence does).
DECODER = Decoder(run_layers, forward_inputs=forward_inputs, decode_inputs=decode_inputs, init_cache=init_cache)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCH)  # MLA + DeepSeek's sigmoid-routed SwiGLU experts with shared experts
class DeepseekV3Target(Target):
    """Frozen DeepSeek-V3 / Kimi K2 target (see module docstring)."""

    config_class = DeepseekV3TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)

    routed_experts_path = ("moe_layers", "experts")  # DeepSeek-V3: 37.6 B active of 671 B

    @classmethod
    def ignored_hf_names(cls, config: DeepseekV3TargetConfig, name: str) -> bool:
        """Also the multi-token-prediction layers after the decoder layers (transformers ignores them)."""
        if super().ignored_hf_names(config, name):
            return True
        m = re.match(r"model\.layers\.(\d+)\.", name)
        n = config.num_hidden_layers
        return m is not None and n <= int(m.group(1)) < n + config.num_nextn_predict_layers

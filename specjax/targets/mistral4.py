"""Mistral 4 frozen target (``Mistral4ForCausalLM``: Mistral Small 4, the text model of
mistralai/Mistral-Small-4-119B-2603) in plain JAX, over DeepSeek-V3's pieces.

Read top to bottom: config + HF key table -> HF weight map (DeepSeek-V3's, without the router's
correction bias) -> blocks (the decoder layer, the softmax-routed MoE) -> layer schedule -> per-call
inputs (the Llama-4 query scale) -> Target class.

Layout (transformers' Mistral4ForCausalLM, 5.25): DeepSeek-V3's decoder (``deepseek_v3.py``) with
these differences, each read from transformers' modeling and configuration code:
  * attention: multi-head latent attention (``layers/mla.py``: query LoRA, compressed KV latent, one
    shared RoPE key, interleaved RoPE pairs when ``rope_interleave``), and each token's whole query
    (nope and rope dims) multiplied by Llama 4's position scale
    ``1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))``
    (both from ``rope_parameters``; the original length is the one YaRN uses). Softmax scale
    (qk_nope + qk_rope)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2, as DeepSeek-V3.
  * RoPE: YaRN only. transformers' Mistral4Config sets head_dim = qk_nope + qk_rope (not
    qk_rope, as DeepSeek-V3's does) and partial_rotary_factor = qk_rope / head_dim, so YaRN's
    frequencies and correction range are those of qk_rope_head_dim dims, exactly DeepSeek-V3's
    tables; its default (non-YaRN) RoPE would rotate head_dim dims against qk_rope-wide queries,
    which transformers cannot run, and is refused.
  * router: softmax over the experts (not DeepSeek's sigmoid), no e_score_correction_bias, the
    choice limited to the topk_group best of n_group groups (a group's score the sum of its two
    best probabilities), the chosen probabilities renormalised when norm_topk_prob, times
    routed_scaling_factor (``layers/routers.softmax_topk``). transformers keeps this router in the
    model dtype; here it stays fp32, as every specjax router does (a bf16 logit can flip an expert).
  * defaults (an absent key means what it means in transformers' Mistral4Config): one expert group,
    no dense layers (first_k_dense_replace 0), x1.0, q_lora_rank 1024, and the rope_parameters of
    Mistral Small 4 (YaRN x128 over 8192 positions, beta 32 / 1, mscale 1, mscale_all_dim 1,
    llama_4_scaling_beta 0.1). No multi-token-prediction layers.

On disk: transformers 5.25 holds, reads and writes each MoE layer's experts fused
(``mlp.experts.gate_up_proj`` [E, 2F, D], gate rows first, and ``mlp.experts.down_proj`` [E, D, F];
it has no conversion to or from one tensor per expert for mistral4); a checkpoint with one tensor
per expert (DeepSeek's ``mlp.experts.{e}.gate_proj.weight`` layout) loads too. The layout is picked
by the checkpoint's tensor names (``Mistral4Target.checkpoint_weight_specs``). Quantized checkpoints
in a format ``targets/quantized.py`` reads (block-scaled FP8, compressed-tensors) load with one
tensor per expert. Mistral publishes Mistral Small 4 as a multimodal ``Mistral3ForConditionalGeneration``
folder whose ``text_config`` is this model, in FP8 with one scale per tensor (``weight_block_size``
null, as third-party tools describe the release): quantized.py does not read that format (its
quantization_config is refused with the fix named), and the multimodal folder is not read as this
text target yet (``multimodal.py`` has no Mistral 3 layout).

Params: DeepSeek-V3's leaves (attention and norms under ``layers``, dense MLPs under
``mlp_layers``, router / experts / shared experts under ``moe_layers``) without
``moe_layers/router/e_score_correction_bias``. Cached decoding: DeepSeek-V3's latent cache and
absorbed attention (the query scale is per token, so a chunk scales as the full sequence does).

Refused with a ValueError naming the key and the fix: RoPE types other than yarn, a missing
``llama_4_scaling_beta``, a partial_rotary_factor / head_dim that is not qk_rope / (qk_nope + qk_rope),
a top-level original_max_position_embeddings that differs from rope_parameters', attention_bias,
activations other than SiLU, num_key_value_heads != num_attention_heads, null for a key transformers
cannot run with null, DeepSeek router keys that ask for another rule (scoring_func other than
softmax, moe_layer_freq != 1), and quantization formats quantized.py does not read.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from specjax.layers.norms import rms_norm
from specjax.layers.rope import YARN_TYPE, RopeSpec, rope_spec_from_hf, yarn_softmax_scale_factor
from specjax.targets import deepseek_v3 as ds
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs
from specjax.targets.hf_keys import HFKey, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import mla
from specjax.targets.layers.routers import check_grouped_topk, router_logits, softmax_topk
from specjax.targets.multimodal import FUSED_GATE_UP, fused_expert_specs
from specjax.targets.quantized import Fp8BlockQuant, weight_quant_from_hf
from specjax.targets.registry import model_type_of, register

ARCH = "Mistral4ForCausalLM"

# config.json keys <-> config fields, with transformers' Mistral4Config defaults (every key has one)
HF_KEYS = (
    HFKey("vocab_size", int, 131072),
    HFKey("hidden_size", int, 4096),
    HFKey("intermediate_size", int, 12288),
    HFKey("moe_intermediate_size", int, 2048),
    HFKey("num_hidden_layers", int, 36),
    HFKey("num_attention_heads", int, 32),
    HFKey("q_lora_rank", int, 1024),  # null: a plain q_proj (from_hf)
    HFKey("kv_lora_rank", int, 256),
    HFKey("qk_nope_head_dim", int, 64),
    HFKey("qk_rope_head_dim", int, 64),
    HFKey("v_head_dim", int, 128),
    HFKey("n_routed_experts", int, lambda hf: hf.get("num_local_experts") or 128),  # Mistral4Config's alias
    HFKey("num_experts_per_tok", int, 4),
    HFKey("n_shared_experts", int, 1),
    HFKey("n_group", int, 1),
    HFKey("topk_group", int, 1),
    HFKey("first_k_dense_replace", int, 0),
    HFKey("norm_topk_prob", bool, True),
    HFKey("routed_scaling_factor", float, 1.0),
    HFKey("rope_interleave", bool, True),
    HFKey("rms_norm_eps", float, 1e-6),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("max_position_embeddings", int, 1048576),
)
# keys transformers' Mistral4 never reads; a value other than these asks for another model
FIXED_KEYS = {"scoring_func": "softmax", "moe_layer_freq": 1}
# Mistral4Config's rope_parameters when config.json has none (its __post_init__)
DEFAULT_ROPE_PARAMETERS = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                           "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                           "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
DEFAULT_ROPE = RopeSpec(YARN_TYPE, 10000.0, factor=128.0, original_max_position_embeddings=8192, mscale=1.0,
                        mscale_all_dim=1.0, attention_factor=1.0)


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Mistral4TargetConfig(ds.DenseThenMoeFields):
    """Hashable subset of the HF Mistral4Config that the forward needs (plus runtime knobs)."""

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
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    llama_4_scaling_beta: float = 0.1  # rope_parameters' (0: no query scaling)
    rope: RopeSpec = DEFAULT_ROPE
    weight_quant: Any = None  # a quantized release's format (targets/quantized.py)
    kernels: KernelChoices = KernelChoices()  # runtime option (moe: the routed experts' kernel)

    # what draft heads and shape reports read: transformers' Mistral4Config sets head_dim to the
    # query/key head width; MLA has no separate KV heads
    @property
    def head_dim(self) -> int:
        return self.qk_head_dim

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
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Mistral4TargetConfig":
        hf, arch = resolve_hf_config(hf, (ARCH,), "Mistral4TargetConfig", unsupported_flags=("attention_bias",),
                                     silu_keys=("hidden_act",))
        for key, want in FIXED_KEYS.items():
            if hf.get(key, want) != want:
                raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported: transformers' Mistral4 routes "
                                 f"with {key}={want!r} whatever the config says. Fix: remove the key, or load the "
                                 "checkpoint as the architecture it was made for")
        nulls = [row.key for row in HF_KEYS if row.key != "q_lora_rank" and row.key in hf and hf[row.key] is None]
        if nulls:
            raise ValueError(f"{arch}: {', '.join(f'{k}=null' for k in nulls)}: transformers' Mistral4 cannot run "
                             "with null there. Fix: write the value (or drop the key for Mistral4Config's default)")
        heads, kv_heads = hf.get("num_attention_heads", 32), hf.get("num_key_value_heads")
        if kv_heads not in (None, heads):
            raise ValueError(f"{arch}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (latent "
                             "attention expands the shared latent into every head). Fix: set it to "
                             f"{heads} or drop it")
        kw = read_hf_keys(HF_KEYS, hf)
        if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
            kw["q_lora_rank"] = None  # transformers: a plain q_proj
        rope, beta = _rope_from_hf(hf, arch, kw["qk_nope_head_dim"], kw["qk_rope_head_dim"],
                                   kw["max_position_embeddings"])
        kw = dict(architecture=arch, rope=rope, llama_4_scaling_beta=beta, weight_quant=weight_quant_from_hf(hf, arch),
                  **kw)
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ValueError naming the config key when the shapes, RoPE or routing cannot work."""
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
        if self.rope.rope_type != YARN_TYPE or self.rope.partial_rotary_factor != 1.0:
            raise ValueError(f"{self.architecture}: rope {self.rope.rope_type!r} (partial_rotary_factor "
                             f"{self.rope.partial_rotary_factor}) is not supported: Mistral 4 rotates the "
                             "qk_rope_head_dim dims with YaRN (rope_type 'yarn')")
        if not math.isfinite(self.llama_4_scaling_beta):
            raise ValueError(f"{self.architecture}: llama_4_scaling_beta={self.llama_4_scaling_beta} must be finite")
        if self.moe_layer_ids:
            check_grouped_topk(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                               self.architecture)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        rope = {**self.rope.to_hf(), "llama_4_scaling_beta": self.llama_4_scaling_beta}
        return {"architectures": [self.architecture], "model_type": model_type_of(self.architecture), "dtype": dtype,
                **hf_values(HF_KEYS, self), "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False,
                "num_key_value_heads": self.num_attention_heads, "head_dim": self.head_dim,
                **({"quantization_config": self.weight_quant.to_hf()} if self.weight_quant else {})}


def _rope_from_hf(hf: Mapping[str, Any], arch: str, nope: int, rope_dim: int,
                  max_positions: int) -> tuple[RopeSpec, float]:
    """(YaRN spec over the qk_rope_head_dim dims, llama_4_scaling_beta) of a Mistral4 config dict, read
    as transformers' Mistral4Config and Mistral4Attention read them; ValueError for what they cannot run."""
    params = hf.get("rope_parameters", hf.get("rope_scaling"))
    params = dict(DEFAULT_ROPE_PARAMETERS if params is None else params)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != YARN_TYPE:
        raise ValueError(f"{arch}: rope_parameters.rope_type={kind!r} is not supported: Mistral4Config sets "
                         f"head_dim = qk_nope_head_dim + qk_rope_head_dim = {nope + rope_dim}, so only YaRN (which "
                         f"rotates head_dim * partial_rotary_factor = {rope_dim} dims) fits the queries. Fix: "
                         "rope_type 'yarn' (Mistral Small 4's)")
    beta = params.pop("llama_4_scaling_beta", None)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise ValueError(f"{arch}: rope_parameters.llama_4_scaling_beta={beta!r}: transformers' Mistral4Attention "
                         "multiplies the queries by 1 + beta * log(1 + floor(position / "
                         "original_max_position_embeddings)) and needs a number. Fix: set it (0.0 for no scaling; "
                         "Mistral Small 4: 0.1)")
    head_dim = hf.get("head_dim") or nope + rope_dim
    if head_dim != nope + rope_dim:
        raise ValueError(f"{arch}: head_dim={head_dim} but qk_nope_head_dim + qk_rope_head_dim = {nope + rope_dim} "
                         "(Mistral4Config sets head_dim to that sum). Fix: drop head_dim or make them agree")
    partial = params.pop("partial_rotary_factor", rope_dim / head_dim)
    if int(head_dim * partial) != rope_dim:
        raise ValueError(f"{arch}: rope_parameters.partial_rotary_factor={partial} rotates int({head_dim} * "
                         f"{partial}) = {int(head_dim * partial)} dims, but qk_rope_head_dim={rope_dim}. Fix: drop "
                         f"it (Mistral4Config's default qk_rope_head_dim / head_dim) or set {rope_dim / head_dim}")
    top = hf.get("original_max_position_embeddings")
    if top is not None and top != params.get("original_max_position_embeddings"):
        raise ValueError(f"{arch}: original_max_position_embeddings={top} at the top level but "
                         f"{params.get('original_max_position_embeddings')} in rope_parameters: transformers' YaRN "
                         "and Llama-4 scaling read the rope_parameters one. Fix: keep one value, in rope_parameters")
    # YaRN's original length: rope_parameters', else max_position_embeddings (transformers' standardization)
    rest = {k: v for k, v in hf.items() if k not in ("partial_rotary_factor", "original_max_position_embeddings",
                                                    "rope_scaling")}
    rest.update(rope_parameters=params, max_position_embeddings=max_positions)
    return rope_spec_from_hf(rest, yarn=True), float(beta)


# =============================================================================================
# HF weight map: DeepSeek-V3's (deepseek_v3.weight_specs: MLA, dense MLPs, MoE with one tensor per
# expert; quantized rows where the checkpoint's format says so) without the correction bias
# =============================================================================================
def weight_specs(cfg: Mistral4TargetConfig) -> list[WeightSpec]:
    return [s for s in ds.weight_specs(cfg) if s.path[-1] != "e_score_correction_bias"]


# =============================================================================================
# Blocks: the decoder layer (DeepSeek-V3's, with the query scale) and the softmax-routed MoE
# =============================================================================================
def decoder_layer(lp: dict, cfg: Mistral4TargetConfig, x_btd, inputs: StackInputs, ffn, cache=None, layer=None):
    """x + MLA(norm(x)) with each token's queries scaled (``inputs.extra``), then + ffn(norm(x))."""
    h = rms_norm(x_btd, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)
    o, cache = mla.mla_block(lp["self_attn"], cfg.mla, h, inputs.mask, inputs.rope, cache=cache, layer=layer,
                             slots_bt=inputs.slots, q_scale_bt=inputs.extra)
    x_btd = x_btd + o
    h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
    return x_btd + ffn(h), cache


def route(mp: dict, cfg: Mistral4TargetConfig, x_td):
    """Mistral 4's router on tokens [T, D]: (expert ids int32 [T, k], fp32 weights [T, k])."""
    return softmax_topk(router_logits(x_td, mp["router"]["kernel"]), cfg.num_experts_per_tok,
                        renormalize=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
                        scaling_factor=cfg.routed_scaling_factor)


# =============================================================================================
# Layer schedule: DeepSeek-V3's (dense layers first, then MoE layers) with this family's router
# =============================================================================================
def run_layers(params: dict, cfg: Mistral4TargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    return ds.dense_then_moe_layers(params, cfg, carry, inputs, aux_ids, decoder_layer, router=route)


# =============================================================================================
# Per-call inputs: DeepSeek-V3's (mask, YaRN tables; cached decoding: slots and the latent cache),
# plus the Llama-4 query scale of each token's position in StackInputs.extra
# =============================================================================================
def llama4_query_scale(cfg: Mistral4TargetConfig, positions_bt):
    """fp32 [B,T] 1 + beta * log(1 + floor(position / original_max_position_embeddings)), or None
    for beta 0 (a scale of exactly 1). A negative position (a left-padding slot) counts as 0, where
    transformers' log would give NaN for a token that is never attended to."""
    if cfg.llama_4_scaling_beta == 0:
        return None
    pos = jnp.maximum(jnp.asarray(positions_bt), 0).astype(jnp.float32)
    blocks = jnp.floor(pos / jnp.float32(cfg.rope.original_max_position_embeddings))
    return 1.0 + jnp.float32(cfg.llama_4_scaling_beta) * jnp.log(1.0 + blocks)


def forward_inputs(cfg: Mistral4TargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    if positions is None:
        b, t = input_ids_bt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inputs = ds.forward_inputs(cfg, input_ids_bt, positions, segment_ids, dtype)
    return inputs._replace(extra=llama4_query_scale(cfg, positions))


def decode_inputs(cfg: Mistral4TargetConfig, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                  valid_from_b, logits_index, dtype):
    inputs, cache = ds.decode_inputs(cfg, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b,
                                     logits_index, dtype)
    return inputs._replace(extra=llama4_query_scale(cfg, positions_bt)), cache


DECODER = Decoder(run_layers, forward_inputs=forward_inputs, decode_inputs=decode_inputs, init_cache=ds.init_cache)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCH)  # MLA with Llama-4 query scaling + softmax-routed SwiGLU experts with shared experts
class Mistral4Target(Target):
    """Frozen Mistral 4 target (see module docstring)."""

    config_class = Mistral4TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)

    routed_experts_path = ("moe_layers", "experts")  # Mistral Small 4: 6.5 B active of 119 B

    @classmethod
    def checkpoint_weight_specs(cls, config: Mistral4TargetConfig, names) -> list[WeightSpec]:
        """The fused expert tensors transformers writes, where the checkpoint has them; else one
        tensor per expert."""
        specs = cls.weight_specs(config)
        if not any(n.endswith(FUSED_GATE_UP) for n in names):
            return specs
        if config.weight_quant is not None:
            kind = "block-scaled FP8" if isinstance(config.weight_quant, Fp8BlockQuant) else "compressed-tensors"
            raise ValueError(f"{config.architecture}: {kind} weights with fused experts (mlp.experts.gate_up_proj) "
                             "are not read; quantized experts load one tensor per expert "
                             "(mlp.experts.{e}.gate_proj.weight, ...). Fix: dequantize the checkpoint to bf16 first")
        return fused_expert_specs(specs)

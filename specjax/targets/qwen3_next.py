"""Qwen3-Next and Qwen3.5 text targets (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``) on the shared decoder: hybrid Gated DeltaNet / gated-attention stacks.

Read top to bottom: config (+ its HF key tables) -> HF weight map -> blocks (gated attention, Gated
DeltaNet, MoE) -> layer schedule -> cached decoding -> Decoder hooks -> Target classes. Semantics
follow transformers 5.25 ``models/qwen3_next`` / ``qwen3_5`` / ``qwen3_5_moe``.

Every layer is x + mixer(norm(x)), then x + ffn(norm(x)), with
  * mixer by ``layer_types``:
      full_attention    GQA with per-head q/k RMSNorm before RoPE, RoPE on the first
                        ``partial_rotary_factor`` (0.25) of each head, and an output gate:
                        o * sigmoid(gate) before o_proj. q_proj writes query and gate together, per
                        head [query (head_dim) | gate (head_dim)]; the forward splits the kernel's
                        columns per head and runs layers/attention.py's output gate with them.
      linear_attention  Gated DeltaNet: q, k, v from the input projection -> depthwise causal conv
                        (kernel ``linear_conv_kernel_dim``, no bias) + SiLU -> the gated delta rule
                        (q, k L2-normalised, decay g = -exp(A_log) * softplus(a + dt_bias), write
                        strength beta = sigmoid(b); specjax_kernels.gated_delta) -> per-head RMSNorm
                        times the weight, times silu(z) -> out_proj. Qwen3-Next packs the projections
                        per key head (``in_proj_qkvz`` [q | k | v | z] and ``in_proj_ba`` [b | a] for
                        each of the ``linear_num_key_heads`` heads, value heads in consecutive
                        groups of Hv / Hk); Qwen3.5 keeps four (``in_proj_qkv`` [q | k | v], ``z``,
                        ``b``, ``a``). The parameters keep the file layout; the forward splits.
  * ffn: a sparse MoE block (softmax router over the experts, top-k, renormalised over the k picks
    when ``norm_topk_prob``, SwiGLU experts; plus a shared SwiGLU expert scaled by
    sigmoid(x @ shared_expert_gate)) on Qwen3-Next's MoE layers (``decoder_sparse_step`` /
    ``mlp_only_layers``, as Qwen3-MoE) and every Qwen3.5-MoE layer (whose router always
    renormalises); a dense SwiGLU elsewhere and in Qwen3.5.
  * RMSNorms (input, post-attention, final, q/k) multiply by 1 + weight in fp32 and cast after
    (``layers/norms.py`` ``unit_offset``); the DeltaNet output norm multiplies by its weight.
Qwen3.5's RoPE is the interleaved multimodal RoPE of Qwen3-VL; text positions are the same on its
three sections, where it equals plain RoPE (what this target computes; images are not supported).

Params: norms of all L layers under ``layers``; attention layers stacked under ``self_attn``,
DeltaNet layers under ``linear_attn``, MoE feed-forwards under ``moe_layers`` (routed experts [Lm, E,
...]), dense ones under ``mlp_layers``; a static schedule maps each layer to its slot in its mixer's
and its feed-forward's stack. transformers writes one tensor per routed expert
(``mlp.experts.{e}.gate_proj.weight``), as Qwen's Qwen3-Next checkpoints do. ``mtp.*`` tensors (the
multi-token-prediction head) are ignored, as transformers does.

Not read: the multimodal ``Qwen3_5(Moe)ForConditionalGeneration`` checkpoints (config under
``text_config``, text weights under ``model.language_model.``; Qwen's published Qwen3.5-MoE files
also fuse the experts into one [E, 2F, D] ``gate_up_proj``); attention biases; sliding windows.
Context parallelism is refused for the DeltaNet layers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from specjax_kernels.gated_delta import gated_delta_rule
from specjax_kernels.gated_delta.conv import causal_conv1d, causal_conv1d_update, gated_delta_rule_update
from specjax_kernels.moe import moe_experts

from specjax import mesh as meshlib
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, rope_spec_from_hf, rope_tables
from specjax.targets.base import Target, WeightSpec, commit_tree_path, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, swiglu, tap_split
from specjax.targets.hf_keys import HFKey, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import AttentionConfig, attention_block, segment_causal_mask
from specjax.targets.layers.mamba2 import EMPTY_LABEL, DecodeChunk, decode_chunk_plan
from specjax.targets.layers.scan import index_layer, layer_scan
from specjax.targets.registry import model_type_of, register

QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE = "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
ARCHS = (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE)
LINEAR, FULL = "linear_attention", "full_attention"
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # transformers: every 4th layer full attention when layer_types is absent
DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' default when the config names none

# =============================================================================================
# HF key tables (config.json key <-> config field), one per architecture, with the defaults of
# transformers' config classes; layer_types and the RoPE are read by from_hf
# =============================================================================================
_SHAPE_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("num_hidden_layers"),
    HFKey("num_attention_heads"),
    HFKey("head_dim", int, 256, zero_is_absent=True),
    HFKey("rms_norm_eps", float, 1e-6),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("max_position_embeddings", int, 32768),
    HFKey("linear_conv_kernel_dim", int, 4),
    HFKey("linear_key_head_dim", int, 128),
    HFKey("linear_value_head_dim", int, 128),
    HFKey("linear_num_key_heads", int, 16),
    HFKey("linear_num_value_heads", int, 32),
)


def _moe_keys(num_experts: int, top_k: int) -> tuple[HFKey, ...]:
    return (HFKey("num_experts", int, num_experts), HFKey("num_experts_per_tok", int, top_k),
            HFKey("moe_intermediate_size", int, 512), HFKey("shared_expert_intermediate_size", int, 512))


def _active_ffn_width(hf: Mapping[str, Any]) -> int:
    """Qwen3.5-MoE configs carry no dense width (its layers are all MoE): what the EAGLE-3 draft copies
    as its MLP width is then the width one token activates (k routed experts + the shared one)."""
    return (int(hf.get("num_experts_per_tok") or 8) * int(hf.get("moe_intermediate_size") or 512)
            + int(hf.get("shared_expert_intermediate_size") or 512))


HF_KEYS: dict[str, tuple[HFKey, ...]] = {
    QWEN3_NEXT: _SHAPE_KEYS + (HFKey("num_key_value_heads", int, 2, zero_is_absent=True),
                               HFKey("intermediate_size")) + _moe_keys(512, 10) + (
        HFKey("norm_topk_prob", bool, True),
        HFKey("decoder_sparse_step", int, 1),
        HFKey("mlp_only_layers", lambda ids: tuple(int(i) for i in ids), ()),
    ),
    QWEN3_5: _SHAPE_KEYS + (HFKey("num_key_value_heads", int, 4, zero_is_absent=True), HFKey("intermediate_size")),
    QWEN3_5_MOE: _SHAPE_KEYS + (HFKey("num_key_value_heads", int, 2, zero_is_absent=True),
                                HFKey("intermediate_size", int, _active_ffn_width)) + _moe_keys(256, 8),
}
# keys whose meaning this target does not implement: refused when set (attention biases, windows)
_REFUSED = ("attention_bias", "use_sliding_window")


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    raw = hf.get("layer_types")
    if raw is None:
        every = int(hf.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
        raw = [FULL if (i + 1) % every == 0 else LINEAR for i in range(num_layers)]
    types = tuple(raw)
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    if bad or len(types) != num_layers:
        raise ValueError(f"layer_types must list {num_layers} entries of {LINEAR!r} / {FULL!r}; got {list(types)}")
    return types


def _rope(hf: dict) -> RopeSpec:
    """RopeSpec of a Qwen3-Next / Qwen3.5 config: partial rotary, 0.25 when the config names no
    factor (transformers' default for these models). Qwen3.5's mrope_section / mrope_interleaved are
    accepted: text positions are the same on every section (module docstring)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is None:
        hf = dict(hf, partial_rotary_factor=DEFAULT_PARTIAL_ROTARY)
    return rope_spec_from_hf(hf, partial_rotary=True, yarn=True)


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Qwen3NextTargetConfig:
    """Hashable subset of transformers' Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5MoeTextConfig that
    the forward needs, plus runtime knobs. ``num_experts`` 0: every feed-forward is dense (Qwen3.5)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense feed-forwards (Qwen3.5-MoE: none; the draft's default width)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    layer_types: tuple[str, ...]
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    rope: RopeSpec = RopeSpec(partial_rotary_factor=DEFAULT_PARTIAL_ROTARY)
    # ---- runtime options, not part of the HF config ----
    kernels: KernelChoices = KernelChoices()  # moe: the routed experts; attention: training and decoding
    # the training forward's gated delta rule (specjax_kernels.gated_delta: None/"auto" = the chunked
    # "xla" form, "reference" = the sequential definition that cached decoding also runs)
    gated_delta_implementation: str | None = None
    # cached decoding: DeltaNet states kept per layer after a chunk (>= the longest verify chunk; a tree
    # chunk needs one per node). See "Cached decoding" below.
    decode_state_window: int = 24

    # ---- derived ----
    @property
    def model_type(self) -> str:
        return model_type_of(self.architecture)

    @property
    def attention(self) -> AttentionConfig:
        return dataclasses.replace(AttentionConfig.of(self, qk_norm=True, output_gate=True), qk_norm_unit_offset=True)

    @property
    def packed_projections(self) -> bool:
        """Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba (else Qwen3.5's four projections)."""
        return self.architecture == QWEN3_NEXT

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_moe(self, layer: int) -> bool:
        """transformers' rule for a sparse feed-forward (Qwen3.5-MoE: every layer, Qwen3.5: none)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Global indices of the layers with this mixer (LINEAR / FULL), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

    @property
    def mlp_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe(i))

    def mixer_slot(self, layer: int) -> int:
        return self.layers_of(self.layer_types[layer]).index(layer)

    def ffn_slot(self, layer: int) -> int:
        return (self.moe_layer_ids if self.is_moe(layer) else self.mlp_layer_ids).index(layer)

    @property
    def num_attention_layers(self) -> int:
        """Rows of the KV cache (one per full-attention layer)."""
        return len(self.layers_of(FULL))

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    # ---- construction ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Qwen3NextTargetConfig":
        """From an HF config dict (config.json contents or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, ARCHS, "Qwen3NextTargetConfig", unsupported_flags=_REFUSED,
                                     silu_keys=("hidden_act",))
        if arch == QWEN3_5_MOE and hf.get("norm_topk_prob") is False:
            raise ValueError(f"{arch} with norm_topk_prob=false: its router always renormalises the top-k "
                             "weights; this config describes another model")
        keys = read_hf_keys(HF_KEYS[arch], hf)
        kw = dict(architecture=arch, rope=_rope(hf), layer_types=_layer_types(hf, keys["num_hidden_layers"]), **keys)
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        check_gqa(self)
        if self.architecture not in ARCHS:
            raise ValueError(f"Qwen3NextTargetConfig handles {list(ARCHS)}, got architecture {self.architecture!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads} (each key head serves "
                             f"Hv / Hk consecutive value heads)")
        if self.linear_conv_kernel_dim < 1 or self.decode_state_window < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim}, decode_state_window="
                             f"{self.decode_state_window} and decoder_sparse_step={self.decoder_sparse_step} "
                             "must be >= 1")
        if (self.architecture == QWEN3_5) != (self.num_experts == 0):
            raise ValueError(f"{self.architecture} with num_experts={self.num_experts}: Qwen3.5 (dense) has no "
                             "experts, Qwen3-Next and Qwen3.5-MoE need them")
        if self.moe_layer_ids and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                             f"{self.num_experts}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} outside 0..{self.num_hidden_layers - 1}")
        if self.rope.rotary_dim(self.head_dim) % 2:
            raise ValueError(f"partial_rotary_factor={self.rope.partial_rotary_factor} of head_dim={self.head_dim} "
                             "rotates an odd number of dims; RoPE rotates pairs")

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        rope = self.rope.to_hf()
        rope["partial_rotary_factor"] = self.rope.partial_rotary_factor  # absent would read as 0.25
        d = {"architectures": [self.architecture], "model_type": self.model_type, "dtype": dtype,
             **hf_values(HF_KEYS[self.architecture], self), "layer_types": list(self.layer_types),
             "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False}
        if "mlp_only_layers" in d:
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d


# =============================================================================================
# HF weight map. "{i}" rows are stacked on a leading layer axis over `layer_ids` (the layers that
# carry the tensor); "{e}" rows also stack experts. transpose=True: HF [out, in] <-> kernel [in, out]
# (conv1d [C, 1, K] <-> [K, 1, C]). Packed projections stay whole (axis None: not split over tensor).
# =============================================================================================
def weight_specs(cfg: Qwen3NextTargetConfig) -> list[WeightSpec]:
    D, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    N, Nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    Hv, K, C = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim, cfg.conv_dim
    E, F, Fs, I = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.intermediate_size
    specs = [WeightSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), False, (V, D), ("vocab", "embed"))]

    def rows(ids, table):
        for name, path, transpose, shape, axes in table:
            specs.append(WeightSpec("model.layers.{i}." + name, path, transpose, (len(ids),) + shape,
                                    ("layers",) + axes, layer_ids=ids))

    every = tuple(range(cfg.num_hidden_layers))
    rows(every, [
        ("input_layernorm.weight", ("layers", "input_layernorm", "scale"), False, (D,), ("norm",)),
        ("post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), False, (D,), ("norm",)),
    ])
    a = ("self_attn",)
    if cfg.layers_of(FULL):
        rows(cfg.layers_of(FULL), [
            # per head [query | gate]: split at the head, so the heads axis shards whole heads
            ("self_attn.q_proj.weight", a + ("q_proj", "kernel"), True, (D, 2 * N * hd), ("embed", "heads")),
            ("self_attn.k_proj.weight", a + ("k_proj", "kernel"), True, (D, Nkv * hd), ("embed", "kv_heads")),
            ("self_attn.v_proj.weight", a + ("v_proj", "kernel"), True, (D, Nkv * hd), ("embed", "kv_heads")),
            ("self_attn.o_proj.weight", a + ("o_proj", "kernel"), True, (N * hd, D), ("heads", "embed")),
            ("self_attn.q_norm.weight", a + ("q_norm", "scale"), False, (hd,), ("head_dim",)),
            ("self_attn.k_norm.weight", a + ("k_norm", "scale"), False, (hd,), ("head_dim",)),
        ])
    la = ("linear_attn",)
    if cfg.layers_of(LINEAR):
        if cfg.packed_projections:
            proj = [("linear_attn.in_proj_qkvz.weight", la + ("in_proj_qkvz", "kernel"), True,
                     (D, C + cfg.value_dim), ("embed", None)),
                    ("linear_attn.in_proj_ba.weight", la + ("in_proj_ba", "kernel"), True, (D, 2 * Hv),
                     ("embed", None))]
        else:
            proj = [("linear_attn.in_proj_qkv.weight", la + ("in_proj_qkv", "kernel"), True, (D, C), ("embed", None)),
                    ("linear_attn.in_proj_z.weight", la + ("in_proj_z", "kernel"), True, (D, cfg.value_dim),
                     ("embed", None)),
                    ("linear_attn.in_proj_b.weight", la + ("in_proj_b", "kernel"), True, (D, Hv), ("embed", None)),
                    ("linear_attn.in_proj_a.weight", la + ("in_proj_a", "kernel"), True, (D, Hv), ("embed", None))]
        rows(cfg.layers_of(LINEAR), proj + [
            ("linear_attn.conv1d.weight", la + ("conv1d", "kernel"), True, (K, 1, C), (None, None, None)),
            ("linear_attn.dt_bias", la + ("dt_bias",), False, (Hv,), (None,)),
            ("linear_attn.A_log", la + ("A_log",), False, (Hv,), (None,)),
            ("linear_attn.norm.weight", la + ("norm", "scale"), False, (cfg.linear_value_head_dim,), (None,)),
            ("linear_attn.out_proj.weight", la + ("out_proj", "kernel"), True, (cfg.value_dim, D), (None, "embed")),
        ])
    m = ("moe_layers",)
    if cfg.moe_layer_ids:
        rows(cfg.moe_layer_ids, [
            ("mlp.gate.weight", m + ("router", "kernel"), True, (D, E), ("embed", None)),
            ("mlp.experts.{e}.gate_proj.weight", m + ("experts", "gate_proj", "kernel"), True, (E, D, F),
             ("experts", "embed", "expert_mlp")),
            ("mlp.experts.{e}.up_proj.weight", m + ("experts", "up_proj", "kernel"), True, (E, D, F),
             ("experts", "embed", "expert_mlp")),
            ("mlp.experts.{e}.down_proj.weight", m + ("experts", "down_proj", "kernel"), True, (E, F, D),
             ("experts", "expert_mlp", "embed")),
            ("mlp.shared_expert.gate_proj.weight", m + ("shared_expert", "gate_proj", "kernel"), True, (D, Fs),
             ("embed", "mlp")),
            ("mlp.shared_expert.up_proj.weight", m + ("shared_expert", "up_proj", "kernel"), True, (D, Fs),
             ("embed", "mlp")),
            ("mlp.shared_expert.down_proj.weight", m + ("shared_expert", "down_proj", "kernel"), True, (Fs, D),
             ("mlp", "embed")),
            ("mlp.shared_expert_gate.weight", m + ("shared_expert_gate", "kernel"), True, (D, 1), ("embed", None)),
        ])
    if cfg.mlp_layer_ids:
        rows(cfg.mlp_layer_ids, [
            ("mlp.gate_proj.weight", ("mlp_layers", "gate_proj", "kernel"), True, (D, I), ("embed", "mlp")),
            ("mlp.up_proj.weight", ("mlp_layers", "up_proj", "kernel"), True, (D, I), ("embed", "mlp")),
            ("mlp.down_proj.weight", ("mlp_layers", "down_proj", "kernel"), True, (I, D), ("mlp", "embed")),
        ])
    specs.append(WeightSpec("model.norm.weight", ("norm", "scale"), False, (D,), ("norm",)))
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", ("lm_head", "kernel"), True, (D, V), ("embed", "vocab")))
    return specs


# =============================================================================================
# Blocks
# =============================================================================================
def norm(x, scale, cfg: Qwen3NextTargetConfig):
    """The decoder's RMSNorms: times 1 + weight in fp32, cast after."""
    return rms_norm(x, scale, cfg.rms_norm_eps, unit_offset=True)


def gated_attention_params(ap: dict, cfg: Qwen3NextTargetConfig) -> dict:
    """One attention layer's params as layers/attention.attention_block takes them: q_proj's per-head
    [query | gate] columns split into q_proj and the output gate's gate_proj."""
    d = ap["q_proj"]["kernel"].shape[0]
    n, hd = cfg.num_attention_heads, cfg.head_dim
    both = ap["q_proj"]["kernel"].reshape(d, n, 2, hd)
    return dict(ap, q_proj={"kernel": both[:, :, 0].reshape(d, n * hd)},
                gate_proj={"kernel": both[:, :, 1].reshape(d, n * hd)})


def deltanet_projections(lp: dict, cfg: Qwen3NextTargetConfig, h_btd):
    """(conv input [B,T,conv_dim] = [q | k | v], z [B,T,Hv,dv], b [B,T,Hv], a [B,T,Hv]) of one layer."""
    b, t, _ = h_btd.shape
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if cfg.packed_projections:  # per key head: [q dk | k dk | v r*dv | z r*dv] and [b r | a r], r = Hv / Hk
        r = hv // hk
        qkvz = (h_btd @ lp["in_proj_qkvz"]["kernel"]).reshape(b, t, hk, 2 * dk + 2 * r * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
        ba = (h_btd @ lp["in_proj_ba"]["kernel"]).reshape(b, t, hk, 2 * r)
        mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1)
        return mixed, z.reshape(b, t, hv, dv), ba[..., :r].reshape(b, t, hv), ba[..., r:].reshape(b, t, hv)
    return (h_btd @ lp["in_proj_qkv"]["kernel"], (h_btd @ lp["in_proj_z"]["kernel"]).reshape(b, t, hv, dv),
            h_btd @ lp["in_proj_b"]["kernel"], h_btd @ lp["in_proj_a"]["kernel"])


def split_qkv(mixed_btc, cfg: Qwen3NextTargetConfig):
    """q, k [B,T,Hk,dk] and v [B,T,Hv,dv] of the conv output."""
    b, t, _ = mixed_btc.shape
    kd = cfg.key_dim
    return (mixed_btc[..., :kd].reshape(b, t, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
            mixed_btc[..., kd:2 * kd].reshape(b, t, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
            mixed_btc[..., 2 * kd:].reshape(b, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim))


def decay_and_beta(lp: dict, b_bth, a_bth):
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32 (the log decay), beta = sigmoid(b)."""
    f32 = jnp.float32
    g = -jnp.exp(lp["A_log"].astype(f32)) * jax.nn.softplus(a_bth.astype(f32) + lp["dt_bias"].astype(f32))
    return g, jax.nn.sigmoid(b_bth)


def conv_kernel(lp: dict, cfg: Qwen3NextTargetConfig):
    return lp["conv1d"]["kernel"].reshape(cfg.linear_conv_kernel_dim, cfg.conv_dim)


def deltanet_output(lp: dict, cfg: Qwen3NextTargetConfig, o_bthv, z_bthv, dtype):
    """RMSNorm of the rule's output per value head (cast to the model dtype first, as transformers'
    rule returns it), times the weight, times silu(z) in fp32; then out_proj."""
    b, t = o_bthv.shape[:2]
    y = rms_norm(o_bthv.astype(dtype), lp["norm"]["scale"], cfg.rms_norm_eps)
    y = (y.astype(jnp.float32) * jax.nn.silu(z_bthv.astype(jnp.float32))).astype(dtype)
    return y.reshape(b, t, cfg.value_dim) @ lp["out_proj"]["kernel"]


def deltanet(lp: dict, cfg: Qwen3NextTargetConfig, h_btd, segment_ids_bt):
    """One Gated DeltaNet mixer over whole sequences (training forward): conv window and recurrent
    state restart at every packed segment (specjax_kernels.gated_delta does both)."""
    if meshlib.context_mesh() is not None:
        raise NotImplementedError("Gated DeltaNet layers (Qwen3-Next / Qwen3.5) under context parallelism are not "
                                  "supported yet; set parallelism.context=1")
    mixed, z, b, a = deltanet_projections(lp, cfg, h_btd)
    mixed = causal_conv1d(mixed, conv_kernel(lp, cfg), segment_ids=segment_ids_bt, activation="silu")
    q, k, v = split_qkv(mixed, cfg)
    g, beta = decay_and_beta(lp, b, a)
    o = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids_bt, implementation=cfg.gated_delta_implementation)
    return deltanet_output(lp, cfg, o, z, h_btd.dtype)


def moe_ffn(mp: dict, cfg: Qwen3NextTargetConfig, h_btd):
    """Routed experts (softmax router, top-k, renormalised with norm_topk_prob) plus the gated shared
    expert."""
    b, t, d = h_btd.shape
    h = h_btd.reshape(b * t, d)
    probs = jax.nn.softmax((h @ mp["router"]["kernel"]).astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    ex = mp["experts"]
    routed = moe_experts(h, ids.astype(jnp.int32), weights.astype(h.dtype), up_edf=ex["up_proj"]["kernel"],
                         down_efd=ex["down_proj"]["kernel"], gate_edf=ex["gate_proj"]["kernel"], activation="silu",
                         implementation=cfg.kernels.moe)
    shared = swiglu(mp["shared_expert"])(h) * jax.nn.sigmoid(h @ mp["shared_expert_gate"]["kernel"])
    return (routed + shared).reshape(b, t, d)


# =============================================================================================
# Layer schedule
# =============================================================================================
def mixer(kind: str, params: dict, cfg: Qwen3NextTargetConfig, h, inputs: StackInputs, cache, slot):
    """The token mixer of a layer of type ``kind`` at ``slot`` of its stack: (out [B,T,D], cache). In
    cached decoding ``slot`` is also the layer's row in its cache leaves ("k"/"v" or "conv"/"delta")."""
    if kind == FULL:
        ap = gated_attention_params(index_layer(params["self_attn"], slot), cfg)
        kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
        out, kv = attention_block(ap, cfg.attention, h, inputs.mask, inputs.rope, cache=kv, layer=slot,
                                  slots_bt=inputs.slots)
        return out, (None if cache is None else dict(cache, **kv))
    lp = index_layer(params["linear_attn"], slot)
    if cache is None:
        return deltanet(lp, cfg, h, inputs.segment_ids), None
    out, conv, state = deltanet_decode(lp, cfg, h, cache["conv"][slot], cache["delta"][slot], inputs.extra)
    return out, dict(cache, conv=cache["conv"].at[slot].set(conv), delta=cache["delta"].at[slot].set(state))


def ffn(params: dict, cfg: Qwen3NextTargetConfig, h, is_moe, slot, kinds: set):
    """The feed-forward at ``slot`` of the MoE or the dense stack; ``kinds`` the kinds (True = MoE)
    the enclosing scan holds: one kind calls it directly, both pick per layer with lax.cond."""
    moe = lambda h, s: moe_ffn(index_layer(params["moe_layers"], s), cfg, h)  # noqa: E731
    dense = lambda h, s: swiglu(index_layer(params["mlp_layers"], s))(h)  # noqa: E731
    if kinds == {True}:
        return moe(h, slot)
    if kinds == {False}:
        return dense(h, slot)
    return jax.lax.cond(is_moe, moe, dense, h, slot)


def decoder_layer(params: dict, cfg: Qwen3NextTargetConfig, x, norm_scales, mix, is_moe, fslot, ffn_kinds: set):
    """One layer: x + mix(norm(x)), then + ffn(norm(x)) with the feed-forward at ``fslot`` (:func:`ffn`).
    ``mix(h) -> (out, cache)`` is the layer's token mixer (:func:`mixer` at its slot); returns (x, cache).
    The multi-token-prediction layer (specjax.drafts.mtp) is this layer around a full-attention mixer."""
    h = norm(x, norm_scales[0], cfg)
    out, cache = mix(h)
    x = x + out.astype(x.dtype)
    h = norm(x, norm_scales[1], cfg)
    return x + ffn(params, cfg, h, is_moe, fslot, ffn_kinds), cache


def run_layers(params: dict, cfg: Qwen3NextTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every layer, split at the taps (taps may sit on either mixer type).

    Training forward: one lax.scan per span over layer indices; a span with both mixer types picks
    per layer with lax.cond. Cached decoding: one lax.scan per run of consecutive layers of one mixer
    type (a run of one included), so each step updates only its own type's cache leaves at a dynamic
    slot, which a cond over types could not (both branches would return the whole cache)."""
    norms = params["layers"]

    def scan(carry, layers):
        mixers = {cfg.layer_types[i] for i in layers}
        ffn_kinds = {cfg.is_moe(i) for i in layers}

        def step(carry, xs):
            (x, cache), (i, full, mslot, is_moe, fslot) = carry, xs

            def mix(h):
                if len(mixers) == 1:
                    return mixer(next(iter(mixers)), params, cfg, h, inputs, cache, mslot)
                # training forward only (no cache): both branches return [B,T,D]
                return jax.lax.cond(full, lambda h, s: mixer(FULL, params, cfg, h, inputs, None, s)[0],
                                    lambda h, s: mixer(LINEAR, params, cfg, h, inputs, None, s)[0], h, mslot), None

            scales = (norms["input_layernorm"]["scale"][i], norms["post_attention_layernorm"]["scale"][i])
            return decoder_layer(params, cfg, x, scales, mix, is_moe, fslot, ffn_kinds)

        xs = (np.asarray(layers, np.int32), np.asarray([cfg.layer_types[i] == FULL for i in layers]),
              np.asarray([cfg.mixer_slot(i) for i in layers], np.int32), np.asarray([cfg.is_moe(i) for i in layers]),
              np.asarray([cfg.ffn_slot(i) for i in layers], np.int32))
        return layer_scan(step, carry, xs)

    def run_span(carry, a, b):
        if carry[1] is None:
            return scan(carry, list(range(a, b)))
        start = a
        for i in range(a + 1, b + 1):  # runs of one mixer type
            if i == b or cfg.layer_types[i] != cfg.layer_types[start]:
                carry = scan(carry, list(range(start, i)))
                start = i
        return carry

    return tap_split(run_span, carry, cfg.num_hidden_layers, aux_ids)


# =============================================================================================
# Cached decoding (generation, regeneration, speculative decoding)
# =============================================================================================
# Same contract as every target's (decoder.Decoder.decode_chunk; rollback = the next chunk starts at
# a smaller slot). Attention layers share a KV cache {"k", "v"} [La,B,S,Hkv,D]; feed-forwards are per
# token. A DeltaNet layer's state is its conv state (the last K-1 conv inputs) and its recurrent
# state; both are kept in a window of W = config.decode_state_window entries labelled by slot, as
# Nemotron-H's Mamba states (layers/mamba2.py "Cached decoding", whose chunk plan this reuses):
#   "conv"  [Ll,B,W,K-1,C] (cache dtype), "delta" [Ll,B,W,Hv,Dk,Dv] fp32, "state_slot" [B,W] int32:
#   entry w holds the states after slot state_slot[b, w] (-2 = empty). A chunk keeps the states
#   after each of its rows (and the ones it started from), so the next chunk starts from the entry
#   labelled start-1 whatever the accepted length was: rollback needs nothing. A chunk longer than
#   the window (a prefill) keeps the states after its ``logits_index`` rows and its last rows.
#   Starting where no state was kept gives NaN, never a silently wrong state.
# In a chunk, row i continues from its parent (the nearest earlier row its chunk mask shows; none: the
# states before the chunk), for the conv window and the recurrence alike (the kernel ops' ``parent``),
# so a tree chunk gives each node the states of its own root-to-node path. Rows before valid_from
# (left padding) are identity steps (zero conv input, g = beta = 0) from a zero state.
# Memory: W states per DeltaNet layer and row, independent of the cache length (Qwen3-Next-80B:
# 32 x 128 x 128 fp32 = 2 MiB each, 48 MiB per layer at W = 24); the conv window is (K-1) C per entry.
class DeltaNetChunk(NamedTuple):
    """What every DeltaNet layer of one decode_chunk call shares."""

    plan: DecodeChunk  # layers/mamba2.decode_chunk_plan: parents, conv taps, window entries and labels
    logits_index: Any  # [B, n] or None: the rows after which a long chunk keeps its states


def init_cache(cfg: Qwen3NextTargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed cache for ``max_len`` slots per row (KV rows rounded up by layers.attention.cache_size_for)."""
    cache = decoding.init_kv_cache(cfg.num_attention_layers, batch_size, max_len, cfg.num_key_value_heads,
                                   cfg.head_dim, dtype)
    n, w = len(cfg.layers_of(LINEAR)), cfg.decode_state_window
    if n:
        cache["conv"] = jnp.zeros((n, batch_size, w, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype)
        cache["delta"] = jnp.zeros((n, batch_size, w, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                    cfg.linear_value_head_dim), jnp.float32)
        cache["state_slot"] = jnp.full((batch_size, w), EMPTY_LABEL, jnp.int32)
    return cache


def decode_inputs(cfg: Qwen3NextTargetConfig, cache: dict, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                  valid_from_b, logits_index, dtype):
    """A chunk's cache mask, write slots and RoPE, and the DeltaNet plan (mamba2.decode_chunk_plan: a
    tree chunk needs ``decode_state_window`` >= T). Returns (StackInputs, cache with the new labels)."""
    start_b, mask, slots = decoding.chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b,
                                                 cfg.attention)
    extra = None
    if cfg.layers_of(LINEAR):
        plan = decode_chunk_plan(cfg.linear_conv_kernel_dim, cache["state_slot"], start_b, chunk_mask_btt,
                                 valid_from_b, logits_index, t=input_ids_bt.shape[1])
        cache = dict(cache, state_slot=plan.labels)
        extra = DeltaNetChunk(plan=plan, logits_index=logits_index)
    rope = rope_tables(cfg.rope, cfg.head_dim, positions_bt, dtype)
    return StackInputs(mask, rope, slots=slots, extra=extra), cache


def conv_states_after(ext_bec, taps_bnk):
    """Conv states (the last K-1 inputs, oldest first) on the paths ending at the rows whose taps are
    ``taps`` [B,n,K] (mamba2.DecodeChunk.taps: ext index of the j-th most recent input, -1 = none) of
    ``ext`` [B, K-1+T, C] = [conv state before the chunk, chunk inputs]: [B, n, K-1, C]."""
    b, n, k = taps_bnk.shape
    idx = taps_bnk[..., : k - 1][..., ::-1].reshape(b, n * (k - 1))
    got = jnp.take_along_axis(ext_bec, jnp.maximum(idx, 0)[..., None], axis=1)
    got = jnp.where((idx >= 0)[..., None], got, jnp.zeros((), got.dtype))
    return got.reshape(b, n, k - 1, ext_bec.shape[-1])


def deltanet_decode(lp: dict, cfg: Qwen3NextTargetConfig, h_btd, conv_bwkc, state_bwhkv, chunk: DeltaNetChunk):
    """One Gated DeltaNet mixer over a chunk with this layer's state window (see the section comment).
    Returns (out [B,T,D], new conv window, new state window)."""
    mixed, z, bb, a = deltanet_projections(lp, cfg, h_btd)
    valid = chunk.plan.row_valid[..., None]
    mixed = jnp.where(valid, mixed, jnp.zeros((), mixed.dtype))
    g, beta = decay_and_beta(lp, bb, a)
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, jnp.zeros((), beta.dtype))
    o, new_conv, new_state = recurrent_window_decode(mixed, g, beta, conv_kernel(lp, cfg), lambda c: split_qkv(c, cfg),
                                                     conv_bwkc, state_bwhkv, chunk, cfg.gated_delta_implementation)
    return deltanet_output(lp, cfg, o, z, h_btd.dtype), new_conv, new_state


def recurrent_window_decode(mixed_btc, g, beta, kernel_kc, split, conv_bwkc, state_bwhkv, chunk: DeltaNetChunk,
                            implementation: str | None = None):
    """The short conv and the gated delta rule of one layer over a chunk, continued from and kept in the
    layer's state window (the section comment), for any projections (Gated DeltaNet's here, Kimi Delta
    Attention's in kimi_linear.py). ``mixed_btc`` the conv input with left-padding rows zeroed, ``g`` [B,T,H] or
    [B,T,H,Dk] and ``beta`` [B,T,H] zero there (identity steps), ``kernel_kc`` the conv kernel [K, C],
    ``split(conv_out) -> (q, k, v)``. Returns (rule output [B,T,H,Dv] fp32, new conv window, new state
    window)."""
    plan = chunk.plan
    b, t, _ = mixed_btc.shape
    w = state_bwhkv.shape[1]
    rows = jnp.arange(b)
    f32 = jnp.float32

    def entry(win):  # zero at a sequence start, the window's entry labelled start-1, else NaN
        e = win[rows, plan.entry_index]
        shape = (b,) + (1,) * (e.ndim - 1)
        e = jnp.where(plan.entry_found.reshape(shape), e, jnp.nan)
        return jnp.where(plan.entry_zero.reshape(shape), jnp.zeros((), e.dtype), e)

    conv0, state0 = entry(conv_bwkc).astype(mixed_btc.dtype), entry(state_bwhkv).astype(f32)
    parent = plan.parent if plan.tree else None
    conv_out, _ = causal_conv1d_update(mixed_btc, conv0, kernel_kc, activation="silu", parent=parent)
    q, k, v = split(conv_out)
    ext = jnp.concatenate([conv0, mixed_btc], axis=1)
    if t + 1 <= w:  # every row's states (and the entry's) are kept, at window entries plan.out_entry
        o, _, states = gated_delta_rule_update(q, k, v, g, beta, state0, parent=parent, return_states=True)
        kept_state = jnp.concatenate([state0[:, None], states], axis=1)  # offsets 0..T
        kept_conv = jnp.concatenate([conv0[:, None], conv_states_after(ext, plan.taps)], axis=1)
        new_state = jnp.zeros(state_bwhkv.shape, f32).at[rows[:, None], plan.out_entry].set(kept_state, mode="drop")
        new_conv = jnp.zeros(conv_bwkc.shape, conv_bwkc.dtype).at[rows[:, None], plan.out_entry].set(
            kept_conv.astype(conv_bwkc.dtype), mode="drop")
        return o, new_conv, new_state.astype(state_bwhkv.dtype)
    # a long chain chunk: the chunked rule for the head, per-row states for the last rows only
    li = chunk.logits_index
    n = 0 if li is None else int(li.shape[1])
    tail = w - n
    head = t - tail
    s_head, outs = state0, []
    if head:
        o_head, s_head = gated_delta_rule(q[:, :head], k[:, :head], v[:, :head], g[:, :head], beta[:, :head],
                                          initial_state=state0, return_final_state=True, implementation=implementation)
        outs.append(o_head)
    o_tail, _, tail_states = gated_delta_rule_update(q[:, head:], k[:, head:], v[:, head:], g[:, head:],
                                                     beta[:, head:], s_head, return_states=True)
    o = jnp.concatenate(outs + [o_tail], axis=1)
    kept_rows = head + jnp.broadcast_to(jnp.arange(tail, dtype=jnp.int32), (b, tail))
    picked = []
    for j in range(n):  # the state after row li[:, j]: the rows after it become identity steps
        keep = jnp.arange(t)[None, :] <= li[:, j:j + 1]  # [B, T]
        keep_g = keep.reshape(keep.shape + (1,) * (g.ndim - 2))
        picked.append(gated_delta_rule(q, k, v, jnp.where(keep_g, g, 0.0), jnp.where(keep[..., None], beta, 0.0),
                                       initial_state=state0, return_final_state=True,
                                       implementation=implementation)[1])
    if n:  # window entries 0..n-1: the logits rows' states, n..W-1: the last rows' (plan.out_entry)
        tail_states = jnp.concatenate([jnp.stack(picked, axis=1), tail_states], axis=1)
        kept_rows = jnp.concatenate([jnp.asarray(li, jnp.int32), kept_rows], axis=1)
    taps = jnp.take_along_axis(plan.taps, kept_rows[..., None], axis=1)
    new_conv = conv_states_after(ext, taps).astype(conv_bwkc.dtype)
    return o, new_conv, tail_states.astype(state_bwhkv.dtype)


def commit_path(cache: dict, start, path, accepted) -> dict:
    """Tree verification's commit (targets.base.commit_tree_path, batch row 0): the K/V of the accepted
    nodes move to the linear slots start+1..start+accepted, and the window's states after node
    path[i] are re-labelled slot start+i (other nodes' states are dropped), so the next chunk resumes
    from the accepted path's states."""
    out = dict(cache, **commit_tree_path({"k": cache["k"], "v": cache["v"]}, start, path, accepted))
    if "state_slot" in cache:
        labels = cache["state_slot"][0]
        i = jnp.arange(path.shape[0])
        on_path = ((labels - start)[:, None] == path[None, :]) & (i[None, :] <= accepted)  # [W, depth+1]
        keep = jnp.where(labels == start - 1, labels, EMPTY_LABEL)  # the states before the chunk stay valid
        relabelled = jnp.where(jnp.any(on_path, axis=1), start + jnp.argmax(on_path, axis=1), keep)
        out["state_slot"] = cache["state_slot"].at[0].set(relabelled.astype(jnp.int32))
    return out


# =============================================================================================
# Decoder hooks
# =============================================================================================
def forward_inputs(cfg: Qwen3NextTargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    """Segment-causal mask and partial RoPE for the attention layers, segment ids for the DeltaNet
    layers (conv window and state restart at every segment start); defaults: arange, one segment."""
    b, t = input_ids_bt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    return StackInputs(segment_causal_mask(segment_ids), rope_tables(cfg.rope, cfg.head_dim, positions, dtype),
                       segment_ids=segment_ids)


def final_norm(params: dict, cfg: Qwen3NextTargetConfig, x):
    return norm(x, params["norm"]["scale"], cfg)


DECODER = Decoder(run_layers, final_norm=final_norm, forward_inputs=forward_inputs, decode_inputs=decode_inputs,
                  init_cache=init_cache)


# =============================================================================================
# Draft compatibility
# =============================================================================================
def check_draft_compat(target_config: Qwen3NextTargetConfig, draft_num_kv_heads: int | None) -> None:
    """Raise unless an EAGLE-3 draft with ``draft_num_kv_heads`` KV heads passes the export validator
    for this target: for a hybrid (linear-attention) target it requires the target's KV-head count
    (specjax_converters.eagle3_validate, the rule Nemotron-H's vLLM serving needed), so a mismatch is
    refused before training rather than after. ``None`` copies the target's, which is always fine."""
    if draft_num_kv_heads is None or not target_config.layers_of(LINEAR):
        return
    want = target_config.num_key_value_heads
    if int(draft_num_kv_heads) != want:
        raise ValueError(
            f"draft num_key_value_heads={draft_num_kv_heads} does not match the target's num_key_value_heads={want}. "
            f"{target_config.architecture} is a hybrid linear-attention / attention target, and the EAGLE-3 export "
            f"validator requires equal KV-head counts for hybrids (vLLM's KV-cache page unification). "
            f"Fix: set draft.num_key_value_heads={want} (or leave it unset to copy the target's).")


# =============================================================================================
# Target wrappers
# =============================================================================================
@register(QWEN3_NEXT, QWEN3_5_MOE)  # Gated DeltaNet / gated attention, routed experts + a gated shared expert
class Qwen3NextTarget(Target):
    """Frozen Qwen3-Next / Qwen3.5-MoE target (see module docstring)."""

    config_class = Qwen3NextTargetConfig
    decoder = DECODER
    commit_path_fn = staticmethod(commit_path)  # tree verification: re-label the accepted path's states
    weight_specs = staticmethod(weight_specs)
    routed_experts_path = ("moe_layers", "experts")  # Qwen3-Next-80B-A3B: 3.9 B active

    @classmethod
    def ignored_hf_names(cls, config: Qwen3NextTargetConfig, name: str) -> bool:
        # the multi-token-prediction head; transformers ignores it too
        return name.startswith("mtp.") or super().ignored_hf_names(config, name)

    @classmethod
    def check_draft_compat(cls, config: Qwen3NextTargetConfig, draft_num_kv_heads: int | None) -> None:
        check_draft_compat(config, draft_num_kv_heads)


@register(QWEN3_5)  # the same layers with dense feed-forwards
class Qwen3_5Target(Qwen3NextTarget):
    """Frozen Qwen3.5 (dense) target (see module docstring)."""

    routed_experts_path = ()

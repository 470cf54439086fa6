"""Kimi Linear frozen target (``KimiLinearForCausalLM``: Kimi-Linear-48B-A3B-Base / -Instruct) in plain JAX.

Read top to bottom: config (+ its HF key table and the layer schedule read from config.json) -> HF
weight map -> blocks (Kimi Delta Attention, MLA without RoPE, the MoE of DeepSeek-V3) -> layer
schedule -> cached decoding -> Decoder hooks -> Target class. Semantics follow transformers 5.25
``models/kimi_linear`` (its torch fallbacks are the parity reference).

Every layer is x + mixer(norm(x)), then x + ffn(norm(x)) (RMSNorm, weight times the normed value), with
  * mixer by ``layer_types`` (config.json: ``linear_attn_config``'s 1-based ``kda_layers`` /
    ``full_attn_layers``; transformers' to_dict also writes the 0-based ``layer_types``):
      linear_attention  Kimi Delta Attention (KDA): q, k, v = h @ q/k/v_proj (H heads of Dk each, no
                        GQA) -> a depthwise causal conv (kernel ``short_conv_kernel_size``, no bias,
                        one per projection: q_conv1d, k_conv1d, v_conv1d) + SiLU -> the gated delta
                        rule with a decay per head and **key channel**: g = -exp(A_log[h]) *
                        softplus((h @ f_a_proj) @ f_b_proj + dt_bias) [B, T, H, Dk], beta =
                        sigmoid(h @ b_proj) [B, T, H], q and k L2-normalised inside, scale Dk ** -0.5
                        (specjax_kernels.gated_delta with a per-channel g) -> per head RMSNorm (eps
                        rms_norm_eps, fp32) times the weight times sigmoid((h @ g_a_proj) @ g_b_proj)
                        -> o_proj.
      full_attention    multi-head latent attention (``layers/mla.py``: plain q_proj or a query LoRA,
                        compressed KV latent of kv_lora_rank + a shared qk_rope_head_dim key part)
                        with **no RoPE** (the published ``mla_use_nope``: the shared key part is
                        concatenated unrotated, as transformers does); softmax scale
                        (qk_nope_head_dim + qk_rope_head_dim) ** -0.5. Positions enter the model only
                        through the order the KDA layers read.
  * ffn: DeepSeek-V3's (``deepseek_v3.moe_ffn``, ``DenseThenMoeFields``): dense SwiGLU layers first
    (``mlp_layer_types`` / ``first_k_dense_replace``, default 1), then MoE layers with the sigmoid
    router (e_score_correction_bias for the choice only, group-limited top-k over num_expert_group
    groups, moe_renormalize, routed_scaling_factor; router weight and bias kept fp32), num_experts
    SwiGLU experts of width moe_intermediate_size and num_shared_experts shared experts.

config.json spells the MoE keys as Moonshot's release does (num_experts, num_experts_per_token,
num_shared_experts, num_expert_group, moe_renormalize, model_max_length); transformers' aliases
(num_local_experts, num_experts_per_tok, n_shared_experts, n_group, norm_topk_prob,
max_position_embeddings) are read too. Ignored as transformers ignores them: ``head_dim`` (it is
qk_rope_head_dim there), rope_theta / rope_scaling (the target has no RoPE; ``rope`` in the config
is only what a draft head copies). Refused with a ValueError naming the key and the fix: anything
else whose value changes the model from what transformers computes (mla_use_nope false, a router
other than sigmoid, moe_layer_freq != 1, use_grouped_topk false with several groups, attention
biases, activations other than SiLU, num_key_value_heads != num_attention_heads, quantization_config,
linear_attn_config keys beyond the five above, dense layers after a sparse one, layer lists that
disagree or leave a layer out, tie_word_embeddings true: transformers' KimiLinear ties nothing).

Params: both norms of all L layers under ``layers``; the MLA layers stacked under ``mla``, the KDA
layers under ``kda`` (A_log kept in its file shape [1, 1, H, 1], dt_bias fp32 as transformers keeps
it), the dense MLPs under ``mlp_layers`` and the MoE layers under ``moe_layers`` (DeepSeek-V3's
leaves, ``deepseek_v3.feedforward_weight_specs``); a static schedule maps each layer to its slot in
its mixer's and its feed-forward's stack.

On disk (Moonshot's release): ``self_attn.{q,k,v}_conv1d.weight`` [C, 1, K], ``self_attn.f_a_proj`` /
``f_b_proj`` / ``dt_bias`` / ``A_log`` / ``b_proj`` / ``g_a_proj`` / ``g_b_proj`` / ``o_norm`` /
``o_proj``; MoE layers under ``block_sparse_moe.`` (``gate.weight``, ``gate.e_score_correction_bias``,
one tensor per expert ``experts.{e}.w1 / w3 / w2.weight`` = gate / up / down, ``shared_experts.*``),
dense layers under ``mlp.``. transformers 5.25's save_pretrained writes the same names except that it
puts the dense layers under ``block_sparse_moe.`` too; both load (``checkpoint_weight_specs``).
Multi-token-prediction layers after the decoder layers (``num_nextn_predict_layers``, 0 in the
release) are ignored, as transformers does.

Cached decoding: the MLA layers keep the latent cache of ``layers/mla.py`` ({"kv", "k_rope"}, one row
per MLA layer); the KDA layers keep their conv inputs and recurrent states in a window of
``decode_state_window`` entries labelled by slot, exactly as Qwen3-Next's Gated DeltaNet layers do
(qwen3_next.py "Cached decoding": the plan of layers/mamba2.decode_chunk_plan, rollback = the next
chunk starting at a smaller slot, tree chunks per root-to-node path, the commit re-labelling the
accepted path's states). The recurrent states are [H, Dk, Dk] fp32 per layer and row: at the 48B
shape 32 x 128 x 128 = 2 MiB, 48 MiB per KDA layer at W = 24.
Context parallelism is refused for the KDA layers (the conv window would cross shards).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from specjax_kernels.gated_delta import gated_delta_rule
from specjax_kernels.gated_delta.conv import causal_conv1d

from specjax import mesh as meshlib
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec
from specjax.targets import deepseek_v3 as ds
from specjax.targets import qwen3_next as qn
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, swiglu, tap_split
from specjax.targets.hf_keys import HFKey, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import mla
from specjax.targets.layers.attention import cache_attention_mask, segment_causal_mask
from specjax.targets.layers.mamba2 import EMPTY_LABEL, decode_chunk_plan
from specjax.targets.layers.routers import check_grouped_topk
from specjax.targets.layers.scan import index_layer, layer_scan
from specjax.targets.registry import model_type_of, register

ARCH = "KimiLinearForCausalLM"
LINEAR, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
DT_BIAS_DTYPE = "float32"  # transformers keeps dt_bias in fp32 in a bf16 model (_keep_in_fp32_modules_strict)


def _optional_int(value):
    return None if value is None else int(value)


def _either(alias: str, convert, default):
    """The default of a row whose key transformers also accepts under ``alias``."""
    return lambda hf: convert(default if hf.get(alias) is None else hf[alias])


# config.json keys <-> config fields; a key may be absent only where transformers' KimiLinearConfig has
# a default, and the default here is that one. Rows with an alias read it when the key is absent.
HF_KEYS = (
    HFKey("vocab_size", int, 163840),
    HFKey("hidden_size", int, 2304),
    HFKey("intermediate_size", int, 9216),  # the dense layers' MLP
    HFKey("moe_intermediate_size", int, 1024),  # each routed (and shared) expert
    HFKey("num_hidden_layers", int, 27),
    HFKey("num_attention_heads", int, 32),
    HFKey("q_lora_rank", _optional_int, None),
    HFKey("kv_lora_rank", int, 512),
    HFKey("qk_nope_head_dim", int, 128),
    HFKey("qk_rope_head_dim", int, 64),
    HFKey("v_head_dim", int, 128),
    HFKey("num_experts", int, _either("num_local_experts", int, 256), field="n_routed_experts"),
    HFKey("num_experts_per_token", int, _either("num_experts_per_tok", int, 8), field="num_experts_per_tok"),
    HFKey("num_shared_experts", int, _either("n_shared_experts", int, 1), field="n_shared_experts"),
    HFKey("num_expert_group", int, _either("n_group", int, 1), field="n_group"),
    HFKey("topk_group", int, 1),
    HFKey("moe_renormalize", bool, _either("norm_topk_prob", bool, True), field="norm_topk_prob"),
    HFKey("routed_scaling_factor", float, 2.446),
    HFKey("rms_norm_eps", float, 1e-5),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("model_max_length", int, _either("max_position_embeddings", int, 1048576),
          field="max_position_embeddings"),
    HFKey("num_nextn_predict_layers", int, 0),  # MTP layers on disk after the decoder layers (ignored)
)
ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts", "num_expert_group": "n_group",
           "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}
# keys of the published config that transformers ignores, at the value its KimiLinear implements
FIXED_KEYS = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1}
LINEAR_ATTN_KEYS = ("head_dim", "num_heads", "short_conv_kernel_size", "kda_layers", "full_attn_layers")
# keys naming features transformers' KimiLinear does not have: refused when set
ABSENT_FEATURES = ("attn_res_block_size", "mla_use_output_gate", "latent_moe_use_norm")
LINEAR_DEFAULTS = {"head_dim": ("linear_head_dim", 128), "num_heads": ("linear_num_heads", 32),
                   "short_conv_kernel_size": ("linear_conv_kernel_dim", 4)}


def _check_fixed(hf: Mapping[str, Any], arch: str) -> None:
    for key, alias in ALIASES.items():
        if hf.get(key) is not None and hf.get(alias) is not None and hf[key] != hf[alias]:
            raise ValueError(f"{arch}: {key}={hf[key]!r} and its alias {alias}={hf[alias]!r} disagree. Fix: keep "
                             f"one of them (transformers reads {alias} as {key})")
    for key, want in FIXED_KEYS.items():
        if hf.get(key) is not None and hf[key] != want:
            raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported: transformers' KimiLinear implements "
                             f"{key}={want!r} only. Fix: a Kimi Linear config with {key}={want!r}")
    for key in ABSENT_FEATURES:
        if hf.get(key) not in (None, False):
            raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported: transformers' KimiLinear has no such "
                             f"feature, so this config describes another model. Fix: drop {key} only if the "
                             "checkpoint does not use it")
    group = hf.get("num_expert_group", hf.get("n_group"))
    if hf.get("use_grouped_topk") is False and group not in (None, 1):
        raise ValueError(f"{arch} with use_grouped_topk=false and num_expert_group={group}: transformers' KimiLinear "
                         "always limits the choice to topk_group groups. Fix: num_expert_group=1 (one group: the "
                         "same router either way)")
    if hf.get("quantization_config") is not None:
        raise ValueError(f"{arch} with a quantization_config is not supported: Kimi Linear targets read unquantized "
                         "checkpoints. Fix: the bf16 release (moonshotai/Kimi-Linear-48B-A3B-*) or a dequantized copy")
    if hf.get("tie_word_embeddings"):
        raise ValueError(f"{arch} with tie_word_embeddings=true is not supported: transformers' KimiLinear keeps its "
                         "own lm_head whatever the flag says (it ties nothing), so the flag's meaning is ambiguous. "
                         "Fix: tie_word_embeddings=false with lm_head.weight in the checkpoint (as released)")
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise ValueError(f"{arch}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (latent "
                         "attention expands the shared latent into every head). Fix: set them equal")


def _linear_attn(hf: Mapping[str, Any], arch: str) -> tuple[dict, dict]:
    """(linear_attn_config as given, {head_dim, num_heads, short_conv_kernel_size}) with transformers'
    precedence: linear_attn_config, then the top-level linear_head_dim / linear_num_heads /
    linear_conv_kernel_dim, then 128 / 32 / 4."""
    lac = hf.get("linear_attn_config") or {}
    if not isinstance(lac, Mapping):
        raise ValueError(f"{arch}: linear_attn_config must be an object, got {lac!r}")
    extra = sorted(set(lac) - set(LINEAR_ATTN_KEYS))
    if extra:
        raise ValueError(f"{arch}: linear_attn_config keys {extra} are not supported (transformers' KimiLinear reads "
                         f"only {list(LINEAR_ATTN_KEYS)}); they describe another kind of KDA. Fix: a Kimi Linear "
                         "config without them")
    dims = {}
    for key, (top, default) in LINEAR_DEFAULTS.items():
        value = lac.get(key)
        if value is None:
            value = default if hf.get(top) is None else hf[top]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arch}: linear_attn_config.{key} (or {top}) must be an integer >= 1, got {value!r}")
        if hf.get(top) is not None and hf[top] != value:
            raise ValueError(f"{arch}: {top}={hf[top]!r} but linear_attn_config.{key}={value!r}; transformers uses "
                             f"the latter. Fix: make them equal")
        dims[key] = value
    return dict(lac), dims


def _layer_types(hf: Mapping[str, Any], lac: Mapping[str, Any], n: int, arch: str) -> tuple[str, ...]:
    """transformers' precedence: layer_types, then linear_attn_config's 1-based full_attn_layers /
    kda_layers (which must cover every layer once), then full attention at layers 4, 8, ... (0-based)."""
    from_lists = None
    if "full_attn_layers" in lac and "kda_layers" in lac:
        full, kda = list(lac["full_attn_layers"] or []), list(lac["kda_layers"] or [])
        ids = full + kda
        if (any(isinstance(i, bool) or not isinstance(i, int) for i in ids) or sorted(ids) != list(range(1, n + 1))):
            raise ValueError(f"{arch}: linear_attn_config's full_attn_layers {full} and kda_layers {kda} must together "
                             f"list each of the 1-based layers 1..{n} exactly once. Fix: complete the two lists")
        from_lists = tuple(FULL if i + 1 in full else LINEAR for i in range(n))
    raw = hf.get("layer_types")
    if raw is None:
        return from_lists or tuple(FULL if i and i % 4 == 0 else LINEAR for i in range(n))
    types = tuple(raw)
    if len(types) != n or not set(types) <= {LINEAR, FULL}:
        raise ValueError(f"{arch}: layer_types must list {n} entries of {LINEAR!r} / {FULL!r}; got {list(types)}")
    if from_lists is not None and from_lists != types:
        raise ValueError(f"{arch}: layer_types {list(types)} disagrees with linear_attn_config's full_attn_layers / "
                         "kda_layers (1-based). Fix: make them describe the same layers, or drop one")
    return types


def _dense_prefix(hf: Mapping[str, Any], n: int, arch: str) -> int:
    """How many leading layers are dense: ``mlp_layer_types`` when given (dense layers first only;
    first_k_dense_replace, if also given, must agree), else first_k_dense_replace (default 1), as
    transformers reads them."""
    given = hf.get("first_k_dense_replace")
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        k = 1 if given is None else int(given)
        if not 0 <= k <= n:
            raise ValueError(f"{arch}: first_k_dense_replace={given} must be in 0..num_hidden_layers={n}")
        return k
    kinds = list(kinds)
    if len(kinds) != n or not set(kinds) <= {DENSE, SPARSE}:
        raise ValueError(f"{arch}: mlp_layer_types must list {DENSE!r} or {SPARSE!r} for each of the num_hidden_layers="
                         f"{n} layers, got {kinds!r}")
    k = kinds.count(DENSE)
    if kinds != [DENSE] * k + [SPARSE] * (n - k):
        raise ValueError(f"{arch}: mlp_layer_types has a dense layer after a sparse one ({kinds!r}); specjax runs the "
                         "dense layers first (first_k_dense_replace) and does not implement other orders")
    if given is not None and int(given) != k:
        raise ValueError(f"{arch}: first_k_dense_replace={given} but mlp_layer_types makes the first {k} layer(s) "
                         "dense; transformers builds the model from mlp_layer_types. Fix: make them agree")
    return k


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class KimiLinearTargetConfig(ds.DenseThenMoeFields):
    """Hashable subset of transformers' KimiLinearConfig that the forward needs, plus runtime knobs.
    The feed-forward fields carry DeepSeek-V3's names (deepseek_v3.moe_ffn and its weight rows read them)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.446
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    rope: RopeSpec = RopeSpec()  # unused by the target (no RoPE): the RoPE a draft head copies (rope_theta)
    # ---- runtime options, not part of the HF config ----
    kernels: KernelChoices = KernelChoices()  # moe: the routed experts; target_attention: the MLA forward
    # the training forward's gated delta rule (None/"auto" = the chunked "xla" form, "reference" = the
    # sequential definition that cached decoding also runs)
    gated_delta_implementation: str | None = None
    decode_state_window: int = 24  # KDA states kept per layer in cached decoding (qwen3_next.py)

    # ---- derived ----
    @property
    def model_type(self) -> str:
        return model_type_of(self.architecture)

    @property
    def head_dim(self) -> int:  # transformers' KimiLinearConfig: head_dim = qk_rope_head_dim (what drafts read)
        return self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_dim(self) -> int:
        """Width of each KDA projection (q, k and v alike): linear_num_heads * linear_head_dim."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.linear_dim

    @property
    def mla(self) -> mla.MLAConfig:
        return mla.MLAConfig(
            num_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, softmax_scale=self.qk_head_dim**-0.5, rope_interleave=False,
            q_block=self.kernels.target_attention_q_block, implementation=self.kernels.target_attention)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Global indices of the layers with this mixer (LINEAR / FULL), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    def mixer_slot(self, layer: int) -> int:
        return self.layers_of(self.layer_types[layer]).index(layer)

    def ffn_slot(self, layer: int) -> int:
        return (self.moe_layer_ids if self.is_moe(layer) else self.mlp_layer_ids).index(layer)

    @property
    def num_attention_layers(self) -> int:
        """Rows of the latent cache (one per MLA layer)."""
        return len(self.layers_of(FULL))

    # ---- construction ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "KimiLinearTargetConfig":
        """From an HF config dict (Moonshot's config.json, or ``KimiLinearConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, (ARCH,), "KimiLinearTargetConfig", unsupported_flags=("attention_bias",),
                                     silu_keys=("hidden_act",))
        _check_fixed(hf, arch)
        lac, dims = _linear_attn(hf, arch)
        keys = read_hf_keys(HF_KEYS, hf)
        n = keys["num_hidden_layers"]
        theta = hf.get("rope_theta")
        kw = dict(architecture=arch, layer_types=_layer_types(hf, lac, n, arch),
                  first_k_dense_replace=_dense_prefix(hf, n, arch), linear_head_dim=dims["head_dim"],
                  linear_num_heads=dims["num_heads"], linear_conv_kernel_dim=dims["short_conv_kernel_size"],
                  rope=RopeSpec("default", 10000.0 if theta is None else float(theta)), **keys)
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ValueError naming the config key when the shapes or the routing cannot work."""
        sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
                 "n_routed_experts", "num_experts_per_tok", "linear_num_heads", "linear_head_dim",
                 "linear_conv_kernel_dim", "decode_state_window")
        bad = [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < 1]
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            bad.append(f"q_lora_rank={self.q_lora_rank}")
        if self.n_shared_experts < 0:
            bad.append(f"num_shared_experts={self.n_shared_experts}")
        if bad:
            raise ValueError(f"{self.architecture}: {', '.join(bad)} must be >= 1 (num_shared_experts >= 0)")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {LINEAR, FULL}:
            raise ValueError(f"{self.architecture}: layer_types must list {self.num_hidden_layers} entries of "
                             f"{LINEAR!r} / {FULL!r}; got {list(self.layer_types)}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"{self.architecture}: first_k_dense_replace={self.first_k_dense_replace} must be in "
                             f"0..num_hidden_layers={self.num_hidden_layers}")
        if self.moe_layer_ids:
            check_grouped_topk(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                               self.architecture)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        kinds = [DENSE if i in self.mlp_layer_ids else SPARSE for i in range(self.num_hidden_layers)]
        return {"architectures": [self.architecture], "model_type": self.model_type, "dtype": dtype,
                **hf_values(HF_KEYS, self), "layer_types": list(self.layer_types), "mlp_layer_types": kinds,
                "first_k_dense_replace": self.first_k_dense_replace, "linear_head_dim": self.linear_head_dim,
                "linear_num_heads": self.linear_num_heads, "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                "num_key_value_heads": self.num_attention_heads, "hidden_act": "silu", "attention_bias": False,
                "rope_theta": self.rope.theta}


# =============================================================================================
# HF weight map. "{i}" rows are stacked on a leading layer axis over `layer_ids` (the layers that carry
# the tensor); "{e}" rows also stack experts. transpose=True: HF [out, in] <-> kernel [in, out] (conv1d
# [C, 1, K] <-> [K, 1, C]). The feed-forward rows are DeepSeek-V3's under Moonshot's names.
# =============================================================================================
DENSE_MODULES = ("mlp", "block_sparse_moe")  # Moonshot's release / transformers 5.25's save_pretrained
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _moonshot_name(spec: WeightSpec, dense_module: str) -> WeightSpec:
    """A feedforward_weight_specs row renamed to the on-disk layout (module docstring)."""
    name = spec.hf_name
    if spec.path[0] == "moe_layers":
        name = name.replace(".mlp.", ".block_sparse_moe.")
        m = re.search(r"\.experts\.\{e\}\.(\w+)\.weight$", name)
        if m:
            name = name[:m.start(1)] + _EXPERT_NAMES[m.group(1)] + name[m.end(1):]
    elif spec.path[0] == "mlp_layers":
        name = name.replace(".mlp.", f".{dense_module}.")
    return dataclasses.replace(spec, hf_name=name)


def layer_weight_specs(cfg: KimiLinearTargetConfig, dense_module: str = "mlp") -> list[WeightSpec]:
    """Every row, with the dense MLPs under ``dense_module`` (one of DENSE_MODULES)."""
    D, N = cfg.hidden_size, cfg.num_attention_heads
    Q, R, Dr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_out, kv_out, o_in = N * cfg.qk_head_dim, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), N * cfg.v_head_dim
    H, Dk, K, C = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, cfg.linear_dim
    specs: list[WeightSpec] = []

    def rows(ids, table, prefix="model.layers.{i}."):
        for name, path, transpose, shape, axes, *dtype in table:
            specs.append(WeightSpec(prefix + name, path, transpose, (len(ids),) + shape, ("layers",) + axes,
                                    layer_ids=ids, dtype=dtype[0] if dtype else None))

    rows(tuple(range(cfg.num_hidden_layers)), [
        ("input_layernorm.weight", ("layers", "input_layernorm", "scale"), False, (D,), ("norm",)),
        ("post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), False, (D,), ("norm",)),
    ])
    m, a = ("mla",), "self_attn."
    if cfg.layers_of(FULL):
        query = ([(a + "q_proj.weight", m + ("q_proj", "kernel"), True, (D, q_out), ("embed", "heads"))] if Q is None
                 else [(a + "q_a_proj.weight", m + ("q_a_proj", "kernel"), True, (D, Q), ("embed", None)),
                       (a + "q_a_layernorm.weight", m + ("q_a_layernorm", "scale"), False, (Q,), ("norm",)),
                       (a + "q_b_proj.weight", m + ("q_b_proj", "kernel"), True, (Q, q_out), (None, "heads"))])
        rows(cfg.layers_of(FULL), query + [
            (a + "kv_a_proj_with_mqa.weight", m + ("kv_a_proj_with_mqa", "kernel"), True, (D, R + Dr), ("embed", None)),
            (a + "kv_a_layernorm.weight", m + ("kv_a_layernorm", "scale"), False, (R,), ("norm",)),
            (a + "kv_b_proj.weight", m + ("kv_b_proj", "kernel"), True, (R, kv_out), (None, "heads")),
            (a + "o_proj.weight", m + ("o_proj", "kernel"), True, (o_in, D), ("heads", "embed")),
        ])
    k = ("kda",)
    if cfg.layers_of(LINEAR):
        # the KDA layers stay whole per device (axis None): the rule runs per head over all of its channels
        rows(cfg.layers_of(LINEAR), [
            (a + "q_proj.weight", k + ("q_proj", "kernel"), True, (D, C), ("embed", None)),
            (a + "k_proj.weight", k + ("k_proj", "kernel"), True, (D, C), ("embed", None)),
            (a + "v_proj.weight", k + ("v_proj", "kernel"), True, (D, C), ("embed", None)),
            (a + "q_conv1d.weight", k + ("q_conv1d", "kernel"), True, (K, 1, C), (None, None, None)),
            (a + "k_conv1d.weight", k + ("k_conv1d", "kernel"), True, (K, 1, C), (None, None, None)),
            (a + "v_conv1d.weight", k + ("v_conv1d", "kernel"), True, (K, 1, C), (None, None, None)),
            (a + "f_a_proj.weight", k + ("f_a_proj", "kernel"), True, (D, Dk), ("embed", None)),
            (a + "f_b_proj.weight", k + ("f_b_proj", "kernel"), True, (Dk, C), (None, None)),
            (a + "dt_bias", k + ("dt_bias",), False, (C,), (None,), DT_BIAS_DTYPE),
            (a + "A_log", k + ("A_log",), False, (1, 1, H, 1), (None, None, None, None)),
            (a + "b_proj.weight", k + ("b_proj", "kernel"), True, (D, H), ("embed", None)),
            (a + "g_a_proj.weight", k + ("g_a_proj", "kernel"), True, (D, Dk), ("embed", None)),
            (a + "g_b_proj.weight", k + ("g_b_proj", "kernel"), True, (Dk, C), (None, None)),
            (a + "o_norm.weight", k + ("o_norm", "scale"), False, (Dk,), (None,)),
            (a + "o_proj.weight", k + ("o_proj", "kernel"), True, (C, D), (None, "embed")),
        ])
    return specs + [_moonshot_name(s, dense_module) for s in ds.feedforward_weight_specs(cfg)]


def weight_specs(cfg: KimiLinearTargetConfig) -> list[WeightSpec]:
    """The weight map of Moonshot's release layout (dense layers under ``mlp.``)."""
    return layer_weight_specs(cfg)


# =============================================================================================
# Blocks
# =============================================================================================
def norm(x, scale, cfg: KimiLinearTargetConfig):
    return rms_norm(x, scale, cfg.rms_norm_eps)


def no_rope(b: int, t: int, dtype):
    """Zero-width RoPE tables: layers/mla.py's rotation of the shared key part and of the queries' last
    qk_rope_head_dim dims passes every dim through unrotated (Kimi Linear's MLA has no RoPE)."""
    empty = jnp.zeros((b, t, 0), dtype)
    return empty, empty


def kda_projections(lp: dict, h_btd):
    """The conv input [B, T, 3C] = [h @ q_proj | h @ k_proj | h @ v_proj] of one KDA layer."""
    return jnp.concatenate([h_btd @ lp[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj")], axis=-1)


def conv_kernel(lp: dict, cfg: KimiLinearTargetConfig):
    """The three depthwise conv kernels as one [K, 3C] (the conv over [q | k | v] is per channel)."""
    kk, c = cfg.linear_conv_kernel_dim, cfg.linear_dim
    return jnp.concatenate([lp[n]["kernel"].reshape(kk, c) for n in ("q_conv1d", "k_conv1d", "v_conv1d")], axis=-1)


def split_qkv(mixed_btc, cfg: KimiLinearTargetConfig):
    """q, k, v [B, T, H, Dk] of the conv output."""
    b, t, _ = mixed_btc.shape
    c, shape = cfg.linear_dim, (b, t, cfg.linear_num_heads, cfg.linear_head_dim)
    return tuple(mixed_btc[..., i * c:(i + 1) * c].reshape(shape) for i in range(3))


def decay_and_beta(lp: dict, cfg: KimiLinearTargetConfig, h_btd):
    """g [B, T, H, Dk] fp32 = -exp(A_log[head]) * softplus((h @ f_a) @ f_b + dt_bias) (one log decay per
    key channel) and beta [B, T, H] = sigmoid(h @ b_proj)."""
    b, t, _ = h_btd.shape
    f32 = jnp.float32
    gate = (h_btd @ lp["f_a_proj"]["kernel"]) @ lp["f_b_proj"]["kernel"]
    gate = (gate.astype(f32) + lp["dt_bias"].astype(f32)).reshape(b, t, cfg.linear_num_heads, cfg.linear_head_dim)
    rate = jnp.exp(lp["A_log"].astype(f32).reshape(cfg.linear_num_heads))
    return -rate[:, None] * jax.nn.softplus(gate), jax.nn.sigmoid(h_btd @ lp["b_proj"]["kernel"])


def kda_output(lp: dict, cfg: KimiLinearTargetConfig, o_bthd, h_btd):
    """The rule's output (cast to the model dtype, as transformers' rule returns it) RMS-normed per head
    in fp32, times the weight and sigmoid((h @ g_a) @ g_b), cast once; then o_proj."""
    b, t = o_bthd.shape[:2]
    f32, dtype = jnp.float32, h_btd.dtype
    gate = ((h_btd @ lp["g_a_proj"]["kernel"]) @ lp["g_b_proj"]["kernel"]).reshape(o_bthd.shape)
    y = o_bthd.astype(dtype).astype(f32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    y = y * lp["o_norm"]["scale"].astype(f32) * jax.nn.sigmoid(gate.astype(f32))
    return y.astype(dtype).reshape(b, t, cfg.linear_dim) @ lp["o_proj"]["kernel"]


def kda(lp: dict, cfg: KimiLinearTargetConfig, h_btd, segment_ids_bt):
    """One KDA mixer over whole sequences (training forward): conv window and recurrent state restart at
    every packed segment (specjax_kernels.gated_delta does both)."""
    if meshlib.context_mesh() is not None:
        raise NotImplementedError("Kimi Delta Attention layers (Kimi Linear) under context parallelism are not "
                                  "supported yet; set parallelism.context=1")
    mixed = causal_conv1d(kda_projections(lp, h_btd), conv_kernel(lp, cfg), segment_ids=segment_ids_bt,
                          activation="silu")
    q, k, v = split_qkv(mixed, cfg)
    g, beta = decay_and_beta(lp, cfg, h_btd)
    o = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids_bt, implementation=cfg.gated_delta_implementation)
    return kda_output(lp, cfg, o, h_btd)


# =============================================================================================
# Layer schedule
# =============================================================================================
def mixer(kind: str, params: dict, cfg: KimiLinearTargetConfig, h, inputs: StackInputs, cache, slot):
    """The token mixer of a layer of type ``kind`` at ``slot`` of its stack: (out [B,T,D], cache). In
    cached decoding ``slot`` is also the layer's row in its cache leaves ("kv"/"k_rope" or "conv"/"delta")."""
    if kind == FULL:
        latent = None if cache is None else {"kv": cache["kv"], "k_rope": cache["k_rope"]}
        out, latent = mla.mla_block(index_layer(params["mla"], slot), cfg.mla, h, inputs.mask, inputs.rope,
                                    cache=latent, layer=slot, slots_bt=inputs.slots)
        return out, (None if cache is None else dict(cache, **latent))
    lp = index_layer(params["kda"], slot)
    if cache is None:
        return kda(lp, cfg, h, inputs.segment_ids), None
    out, conv, state = kda_decode(lp, cfg, h, cache["conv"][slot], cache["delta"][slot], inputs.extra)
    return out, dict(cache, conv=cache["conv"].at[slot].set(conv), delta=cache["delta"].at[slot].set(state))


def ffn(params: dict, cfg: KimiLinearTargetConfig, h, is_moe, slot, kinds: set):
    """The feed-forward at ``slot`` of the MoE or the dense stack; ``kinds`` the kinds (True = MoE) the
    enclosing scan holds: one kind calls it directly, both pick per layer with lax.cond."""
    moe = lambda h, s: ds.moe_ffn(index_layer(params["moe_layers"], s), cfg)(h)  # noqa: E731
    dense = lambda h, s: swiglu(index_layer(params["mlp_layers"], s))(h)  # noqa: E731
    if kinds == {True}:
        return moe(h, slot)
    if kinds == {False}:
        return dense(h, slot)
    return jax.lax.cond(is_moe, moe, dense, h, slot)


def run_layers(params: dict, cfg: KimiLinearTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every layer, split at the taps. Training forward: one lax.scan per span, picking the mixer and
    the feed-forward per layer with lax.cond where the span holds both kinds. Cached decoding: one scan
    per run of consecutive layers of one mixer type, so each step updates only its own type's cache
    leaves (qwen3_next.run_layers)."""
    norms = params["layers"]

    def scan(carry, layers):
        mixers = {cfg.layer_types[i] for i in layers}
        ffn_kinds = {cfg.is_moe(i) for i in layers}

        def step(carry, xs):
            (x, cache), (i, full, mslot, is_moe, fslot) = carry, xs
            h = norm(x, norms["input_layernorm"]["scale"][i], cfg)
            if len(mixers) == 1:
                out, cache = mixer(next(iter(mixers)), params, cfg, h, inputs, cache, mslot)
            else:  # training forward only (no cache): both branches return [B,T,D]
                out = jax.lax.cond(full, lambda h, s: mixer(FULL, params, cfg, h, inputs, None, s)[0],
                                   lambda h, s: mixer(LINEAR, params, cfg, h, inputs, None, s)[0], h, mslot)
            x = x + out.astype(x.dtype)
            h = norm(x, norms["post_attention_layernorm"]["scale"][i], cfg)
            return x + ffn(params, cfg, h, is_moe, fslot, ffn_kinds).astype(x.dtype), cache

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
# Cached decoding: the MLA latent cache and the KDA state window (module docstring)
# =============================================================================================
def init_cache(cfg: KimiLinearTargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed {"kv", "k_rope"} [La, B, S, .] for the MLA layers and, with KDA layers, {"conv" [Ll, B, W,
    K-1, 3C] (cache dtype), "delta" [Ll, B, W, H, Dk, Dk] fp32, "state_slot" [B, W] int32}."""
    cache = mla.init_cache(cfg.num_attention_layers, batch_size, max_len, cfg.mla, dtype)
    n, w = len(cfg.layers_of(LINEAR)), cfg.decode_state_window
    if n:
        dk = cfg.linear_head_dim
        cache["conv"] = jnp.zeros((n, batch_size, w, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype)
        cache["delta"] = jnp.zeros((n, batch_size, w, cfg.linear_num_heads, dk, dk), jnp.float32)
        cache["state_slot"] = jnp.full((batch_size, w), EMPTY_LABEL, jnp.int32)
    return cache


def decode_inputs(cfg: KimiLinearTargetConfig, cache: dict, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                  valid_from_b, logits_index, dtype):
    """A chunk's latent-cache mask and write slots, and the KDA plan (mamba2.decode_chunk_plan: a tree
    chunk needs ``decode_state_window`` >= T). Positions are not read (no RoPE). Returns (StackInputs,
    cache with the new state labels)."""
    b, t = input_ids_bt.shape
    start_b = jnp.asarray(start_b, jnp.int32).reshape(b)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    mask = cache_attention_mask(start_b, cache["kv"].shape[2], causal if chunk_mask_btt is None else chunk_mask_btt,
                                valid_from_b)
    slots = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    extra = None
    if cfg.layers_of(LINEAR):
        plan = decode_chunk_plan(cfg.linear_conv_kernel_dim, cache["state_slot"], start_b, chunk_mask_btt,
                                 valid_from_b, logits_index, t=t)
        cache = dict(cache, state_slot=plan.labels)
        extra = qn.DeltaNetChunk(plan=plan, logits_index=logits_index)
    return StackInputs(mask, no_rope(b, t, dtype), slots=slots, extra=extra), cache


def kda_decode(lp: dict, cfg: KimiLinearTargetConfig, h_btd, conv_bwkc, state_bwhkv, chunk: qn.DeltaNetChunk):
    """One KDA mixer over a chunk with this layer's state window. Rows before valid_from (left padding)
    are identity steps from a zero state. Returns (out [B,T,D], new conv window, new state window)."""
    valid = chunk.plan.row_valid[..., None]  # [B, T, 1]
    mixed = jnp.where(valid, kda_projections(lp, h_btd), jnp.zeros((), h_btd.dtype))
    g, beta = decay_and_beta(lp, cfg, h_btd)
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid, beta, jnp.zeros((), beta.dtype))
    o, conv, state = qn.recurrent_window_decode(mixed, g, beta, conv_kernel(lp, cfg), lambda m: split_qkv(m, cfg),
                                                conv_bwkc, state_bwhkv, chunk, cfg.gated_delta_implementation)
    return kda_output(lp, cfg, o, h_btd), conv, state


def commit_path(cache: dict, start, path, accepted) -> dict:
    """Tree verification's commit: the accepted nodes' latents move to the linear slots and the KDA
    window's states after the path's nodes are re-labelled (qwen3_next.commit_path, whose K/V here are
    the latent cache's two slot-indexed leaves)."""
    kv = {"k": cache["kv"], "v": cache["k_rope"]}
    if "state_slot" in cache:
        kv["state_slot"] = cache["state_slot"]
    out = qn.commit_path(kv, start, path, accepted)
    moved = dict(cache, kv=out["k"], k_rope=out["v"])
    if "state_slot" in cache:
        moved["state_slot"] = out["state_slot"]
    return moved


# =============================================================================================
# Decoder hooks
# =============================================================================================
def forward_inputs(cfg: KimiLinearTargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    """Segment-causal mask for the MLA layers, segment ids for the KDA layers (conv window and state
    restart at every segment start); positions are not read (no RoPE)."""
    b, t = input_ids_bt.shape
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    return StackInputs(segment_causal_mask(segment_ids), no_rope(b, t, dtype), segment_ids=segment_ids)


DECODER = Decoder(run_layers, forward_inputs=forward_inputs, decode_inputs=decode_inputs, init_cache=init_cache)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCH)  # KDA (per-channel gated delta rule) / MLA without RoPE, DeepSeek-V3's MoE
class KimiLinearTarget(Target):
    """Frozen Kimi Linear target (see module docstring)."""

    config_class = KimiLinearTargetConfig
    decoder = DECODER
    commit_path_fn = staticmethod(commit_path)  # tree verification: re-label the accepted path's states
    weight_specs = staticmethod(weight_specs)
    routed_experts_path = ("moe_layers", "experts")  # Kimi-Linear-48B-A3B: 3.48 B active of 49.12 B

    @classmethod
    def checkpoint_weight_specs(cls, config: KimiLinearTargetConfig, names) -> list[WeightSpec]:
        """Moonshot's release keeps the dense layers under ``mlp.``; transformers 5.25's save_pretrained
        writes them under ``block_sparse_moe.``: the names on disk pick."""
        saved = any(re.fullmatch(r"model\.layers\.\d+\.block_sparse_moe\.gate_proj\.weight", n) for n in names)
        return layer_weight_specs(config, DENSE_MODULES[1] if saved else DENSE_MODULES[0])

    @classmethod
    def ignored_hf_names(cls, config: KimiLinearTargetConfig, name: str) -> bool:
        """Also the multi-token-prediction layers after the decoder layers (transformers ignores them)."""
        if super().ignored_hf_names(config, name):
            return True
        m = re.match(r"model\.layers\.(\d+)\.", name)
        n = config.num_hidden_layers
        return m is not None and n <= int(m.group(1)) < n + config.num_nextn_predict_layers

    @classmethod
    def check_draft_compat(cls, config: KimiLinearTargetConfig, draft_num_kv_heads: int | None) -> None:
        """A hybrid target: the EAGLE-3 export needs the draft's KV heads to equal the target's
        (qwen3_next.check_draft_compat)."""
        qn.check_draft_compat(config, draft_num_kv_heads)

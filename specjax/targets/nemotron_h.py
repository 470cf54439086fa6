"""Nemotron-H frozen target (``NemotronHForCausalLM``): hybrid Mamba-2 / attention / MoE / MLP stack.

Read top to bottom: block types -> config -> HF weight map -> init -> blocks -> layer schedule ->
cached decoding's cache and inputs -> draft check -> Target class (the skeleton around the blocks:
decoder.py). Semantics follow transformers 5.24 ``models/nemotron_h/modeling_nemotron_h.py``:

  block i (type from ``layers_block_type``):  x = x + mixer_i(RMSNorm_i(x))
    linear_attention  Mamba-2 mixer (layers/mamba2.py; SSD scan in specjax_kernels.ssd)
    full_attention    GQA self-attention, causal, **no positional encoding** (Nemotron-H attention
                      applies no RoPE; order comes from the Mamba layers), scale head_dim**-0.5
    moe               sigmoid router (+ e_score_correction_bias for the choice only, DeepSeek-V3
                      style group-limited top-k), weights = sigmoid scores of the chosen experts,
                      renormalised (norm_topk_prob) and times routed_scaling_factor; non-gated
                      experts down(act(up(x))) (optionally inside a latent projection); plus one
                      always-on shared expert MLP on the block input
    mlp               down(act(up(x))), act = mlp_hidden_act (relu2 = squared ReLU)
  final norm ``norm_f``, untied ``lm_head``. RMSNorms multiply the weight in fp32 before the cast
  back (unlike Llama's RMSNorm).

Parameters are nested dicts, one stack per block type (``params["mamba"]`` holds every Mamba
layer stacked on a leading axis, in layer order; likewise ``attention``, ``moe``, ``mlp``). The
forward scans over layer indices and dispatches each layer to its type with ``lax.switch``, reading
that type's stack at the layer's slot in place; the scan is split at the aux taps so only the
three tapped states are kept (taps may sit on any block type).

On disk (transformers' save_pretrained and NVIDIA's checkpoints alike) names start with
``backbone.`` and routed experts are stored one tensor per expert
(``backbone.layers.{i}.mixer.experts.{e}.up_proj.weight``); those are stacked into [E, ...]
leaves. ``mtp.*`` tensors (the multi-token-prediction head) are ignored, as transformers does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.targets.base import Target, WeightSpec, commit_tree_path, resolve_hf_config, tree_set
from specjax.targets.decoder import Decoder, StackInputs, tap_split
from specjax.targets.hf_keys import HFKey, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import AttentionConfig, attention_block, segment_causal_mask
from specjax.targets.layers.mamba2 import (EMPTY_LABEL, Mamba2Dims, decode_chunk_plan, mamba2_decode,
                                           mamba2_mixer)
from specjax.layers.rope import RopeSpec, rope_spec_from_hf
from specjax.targets.layers.scan import index_layer, layer_scan
from specjax.targets.registry import model_type_of, register
from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.moe import moe_experts

ARCHITECTURE = "NemotronHForCausalLM"
MODEL_TYPE = model_type_of(ARCHITECTURE)

# =============================================================================================
# Block types (transformers 5.24 names) and the older spellings configs still carry
# =============================================================================================
MAMBA, ATTENTION, MOE, MLP = "linear_attention", "full_attention", "moe", "mlp"
BLOCK_TYPES = (MAMBA, ATTENTION, MOE, MLP)
_PARAM_KEY = {MAMBA: "mamba", ATTENTION: "attention", MOE: "moe", MLP: "mlp"}
_LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}  # transformers' remap_legacy_layer_types
_PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "E": MOE, "-": MLP}  # hybrid_override_pattern
# Older config keys transformers renames in NemotronHConfig.__post_init__ (old name -> new name).
_KEY_ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
}

def _optional_int(v):
    return None if v is None else int(v)


# config.json keys -> config fields, with transformers' NemotronHConfig defaults (the block pattern,
# activation, time_step_limit and rope are read by NemotronHTargetConfig.from_hf)
HF_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("num_attention_heads", int, 32),
    HFKey("num_key_value_heads", default=lambda hf: int(hf.get("num_attention_heads") or 32), zero_is_absent=True),
    HFKey("head_dim", default=lambda hf: int(hf["hidden_size"]) // int(hf.get("num_attention_heads") or 32),
          zero_is_absent=True),
    HFKey("intermediate_size", int, 21504),
    HFKey("mamba_num_heads", int, 128),
    HFKey("mamba_head_dim", int, 64),
    HFKey("n_groups", int, 8),
    HFKey("ssm_state_size", int, 128),
    HFKey("conv_kernel", int, 4),
    HFKey("chunk_size", int, 128),
    HFKey("use_conv_bias", bool, True),
    HFKey("n_routed_experts", default=lambda hf: hf.get("num_local_experts", 8)),
    HFKey("num_experts_per_tok", int, 2),
    HFKey("moe_intermediate_size", int, 7688),
    HFKey("moe_shared_expert_intermediate_size", int, 7688),
    HFKey("moe_latent_size", _optional_int, None),
    HFKey("n_group", int, 1),
    HFKey("topk_group", int, 1),
    HFKey("norm_topk_prob", bool, True),
    HFKey("routed_scaling_factor", float, 1.0),
    HFKey("layer_norm_epsilon", float, 1e-5),
    HFKey("max_position_embeddings", int, 4096),
)

_ACTIVATIONS = {
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # transformers' ReLUSquaredActivation
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def parse_block_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """Block types from ``layers_block_type`` / ``layer_types`` (list) or ``hybrid_override_pattern``
    (string of M * E -); legacy names mapped; unknown names raise listing the supported ones."""
    raw = hf.get("layers_block_type") or hf.get("layer_types")
    if raw is None and hf.get("hybrid_override_pattern"):
        pattern = str(hf["hybrid_override_pattern"])
        bad = sorted(set(pattern) - set(_PATTERN_CHARS))
        if bad:
            raise ValueError(
                f"hybrid_override_pattern has unknown block symbols {bad}; supported: "
                + ", ".join(f"{c!r}={t}" for c, t in _PATTERN_CHARS.items())
            )
        raw = [_PATTERN_CHARS[c] for c in pattern]
    if not raw:
        raise ValueError("Nemotron-H config needs layers_block_type (or hybrid_override_pattern)")
    types = tuple(_LEGACY_NAMES.get(t, t) for t in raw)
    bad = sorted(set(types) - set(BLOCK_TYPES))
    if bad:
        raise ValueError(f"unsupported Nemotron-H block type(s) {bad}; supported: {', '.join(BLOCK_TYPES)}")
    return types


def _finite_or_inf(v) -> float:
    # transformers writes float('inf') into config.json as {"__float__": "Infinity"}
    if isinstance(v, Mapping) and "__float__" in v:
        v = v["__float__"]
    return float(v)


def _dt_limit(v) -> tuple[float, float]:
    """config.time_step_limit (alias mamba_dt_limit) -> (lo, hi); absent/null -> (0, inf), i.e. no clamp."""
    if v is None:
        return (0.0, float("inf"))
    lo, hi = v
    return (_finite_or_inf(lo), _finite_or_inf(hi))


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class NemotronHTargetConfig:
    """Hashable subset of ``NemotronHConfig`` that the forward needs, plus runtime knobs.

    ``rope`` / ``rms_norm_eps`` / ``intermediate_size`` are also what the EAGLE-3 draft copies from
    its target (drafts.eagle3.config_from_target). The target itself uses no RoPE; ``rope`` is the
    draft's, read from the HF config the same way the export validator reads it (theta 10000 when
    the config names none).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # MLP blocks
    mlp_hidden_act: str
    # Mamba-2
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    # clamp(softplus(dt + dt_bias), *dt_limit), from config.time_step_limit (default (0, inf): no clamp),
    # as mamba_ssm, vLLM, NVIDIA's remote code and transformers >= 5.25. time_step_min (0.001) only sets
    # the dt_bias init range; transformers <= 5.24 wrongly clamped at it (Zamba2's torch_forward).
    dt_limit: tuple[float, float]
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    rope: RopeSpec = RopeSpec()
    # ---- runtime options, not part of the HF config ----
    kernels: KernelChoices = KernelChoices()  # moe: the routed experts' kernel; ssd: the Mamba-2 scan's
    weight_prefix: str = "backbone"  # on-disk name prefix (transformers writes "backbone.")
    # cached decoding: SSM states kept per Mamba layer after a chunk (>= the longest verify chunk; a
    # tree chunk needs one per node). See "Cached decoding" below and layers/mamba2.py.
    decode_state_window: int = 24

    # ---- derived ----
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig.of(self)  # no q/k norm; the forward passes no RoPE

    @property
    def mamba_dims(self) -> Mamba2Dims:
        return Mamba2Dims(
            num_heads=self.mamba_num_heads, head_dim=self.mamba_head_dim, n_groups=self.n_groups,
            state_size=self.ssm_state_size, conv_kernel=self.conv_kernel, chunk_size=self.chunk_size,
            eps=self.layer_norm_epsilon, dt_limit=self.dt_limit, ssd_implementation=self.kernels.ssd,
        )

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Global indices of the blocks of one type, in order (= slots of that type's param stack)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def layer_slots(self) -> tuple[int, ...]:
        """slot[i] = position of block i inside its type's stack."""
        seen: dict[str, int] = {}
        out = []
        for t in self.layer_types:
            out.append(seen.get(t, 0))
            seen[t] = out[-1] + 1
        return tuple(out)

    @property
    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def has_mamba(self) -> bool:
        return MAMBA in self.layer_types

    # ---- construction ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "NemotronHTargetConfig":
        """From an HF config dict (config.json contents or ``NemotronHConfig.to_dict()``)."""
        hf, _ = resolve_hf_config(hf, (ARCHITECTURE,), "NemotronHTargetConfig", silu_keys=("mamba_hidden_act",))
        for old, new in _KEY_ALIASES.items():
            if old in hf and new not in hf:
                hf[new] = hf[old]
        types = parse_block_types(hf)
        n_declared = hf.get("num_hidden_layers")
        if n_declared is not None and int(n_declared) != len(types):
            raise ValueError(
                f"num_hidden_layers={n_declared} but the block pattern lists {len(types)} blocks; "
                "fix the config so both agree"
            )
        # Reject what transformers' NemotronH would silently treat differently from the config's intent.
        if hf.get("use_bias"):
            raise ValueError("Nemotron-H with use_bias=true (Mamba in/out_proj biases) is not supported")
        if hf.get("mlp_bias"):
            raise ValueError("Nemotron-H with mlp_bias=true is not supported")
        if hf.get("tie_word_embeddings"):
            raise ValueError(
                "Nemotron-H with tie_word_embeddings=true is not supported (transformers' "
                "NemotronHForCausalLM never ties lm_head to the embeddings)"
            )
        act = hf.get("mlp_hidden_act", "relu2")
        if act not in _ACTIVATIONS:
            raise ValueError(f"mlp_hidden_act={act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        kw = dict(architecture=ARCHITECTURE, layer_types=types, mlp_hidden_act=act,
                  dt_limit=_dt_limit(hf.get("time_step_limit")), rope=rope_spec_from_hf(hf),
                  **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        if "dt_limit" in overrides:
            kw["dt_limit"] = tuple(float(v) for v in overrides["dt_limit"])
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.has_mamba:
            self.mamba_dims.validate()
        if self.decode_state_window < 1:
            raise ValueError(f"decode_state_window must be >= 1, got {self.decode_state_window}")
        if MOE in self.layer_types:
            e, g = self.n_routed_experts, self.n_group
            if e % g or not 1 <= self.topk_group <= g:
                raise ValueError(
                    f"MoE routing: n_routed_experts={e} must split into n_group={g} equal groups and "
                    f"1 <= topk_group={self.topk_group} <= n_group"
                )
            if g > 1 and e // g < 2:
                raise ValueError(f"MoE routing scores groups by their top-2 experts: need >= 2 experts per group, got {e // g}")
            if not 1 <= self.num_experts_per_tok <= self.topk_group * (e // g):
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.topk_group * (e // g)} "
                    f"(experts in the topk_group={self.topk_group} selected groups)"
                )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict (transformers-5.24 layout) that transformers and ``from_hf`` both read."""
        d = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": dtype, **hf_values(HF_KEYS, self),
             "layers_block_type": list(self.layer_types), "mlp_hidden_act": self.mlp_hidden_act,
             "mamba_hidden_act": "silu", "time_step_limit": list(self.dt_limit),
             "tie_word_embeddings": False, "use_bias": False, "mlp_bias": False, "attention_bias": False}
        if self.rope != RopeSpec():
            d["rope_parameters"] = self.rope.to_hf()
        return d


# The published shape of NVIDIA Nemotron 3 Nano 30B-A3B, which Nemotron 3.5 Lightning 30B-A3B shares
# (NeMo Customizer model docs). Figures: Megatron-Bridge `Nemotron3NanoProvider` (pattern, widths,
# 128 experts / top-6 / scaling 2.5, 2 KV heads, Mamba 64 heads x 64, 8 groups, state 128) and
# transformers' NemotronHConfig defaults (conv 4, chunk 128, eps 1e-5). Attention blocks sit at
# 5, 12, 19, 26, 33, 42, as the Lightning EAGLE-3 card states. ~31.6B parameters.
NEMOTRON_3_NANO_30B_A3B_HF_CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
    "vocab_size": 131072, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_hidden_layers": 52,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
    "intermediate_size": 1856, "mlp_hidden_act": "relu2",
    "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "time_step_min": 0.001,
    "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "layer_norm_epsilon": 1e-5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
}


# transformers keeps the MoE router weight and its correction bias in fp32 inside a bf16 model
# (_keep_in_fp32_modules_strict), and bf16-rounded router weights flip expert choices: on the tiny
# parity model a bf16 load with a bf16 router is 0.34 rel. off transformers' bf16 logits, with an
# fp32 router 0.02 (transformers' own bf16-vs-fp32 gap). Router rows therefore ask for fp32 leaves
# through WeightSpec.dtype, which the loader honours.
ROUTER_DTYPE = "float32"
_FP32_LEAF = {"dtype": ROUTER_DTYPE}


# =============================================================================================
# HF weight map: one row per tensor kind and block type. "{i}" rows are stacked over the layers of
# that type (WeightSpec.layer_ids); "{e}" rows additionally over the experts: leaf [n_layers, E, ...].
# transpose=True: HF nn.Linear weight [out, in] <-> kernel [in, out]; conv1d [C, 1, K] <-> [K, 1, C].
# =============================================================================================
def weight_specs(cfg: NemotronHTargetConfig) -> list[WeightSpec]:
    D, V, pre = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
    specs = [WeightSpec(f"{pre}.embeddings.weight", ("embeddings", "embedding"), False, (V, D), ("vocab", "embed"))]
    for kind in BLOCK_TYPES:
        ids = cfg.layers_of(kind)
        if not ids:
            continue
        key = _PARAM_KEY[kind]

        def row(name, path, transpose, shape, axes, ids=ids, key=key, **extra):
            specs.append(WeightSpec(f"{pre}.layers.{{i}}.{name}", (key,) + path, transpose,
                                    (len(ids),) + shape, ("layers",) + axes, layer_ids=ids, **extra))

        row("norm.weight", ("norm", "scale"), False, (D,), ("norm",))
        if kind == MAMBA:
            m = cfg.mamba_dims
            H, I, C = m.num_heads, m.intermediate_size, m.conv_dim
            # in_proj packs [z | x B C | dt] on one output axis: kept whole and replicated over
            # `tensor` (sharding it would cut across the three parts); FSDP shards the embed axis.
            row("mixer.in_proj.weight", ("mixer", "in_proj", "kernel"), True, (D, m.in_proj_size), ("embed", None))
            row("mixer.conv1d.weight", ("mixer", "conv1d", "kernel"), True, (m.conv_kernel, 1, C), (None, None, None))
            if cfg.use_conv_bias:
                row("mixer.conv1d.bias", ("mixer", "conv1d", "bias"), False, (C,), (None,))
            row("mixer.dt_bias", ("mixer", "dt_bias"), False, (H,), (None,))
            row("mixer.A_log", ("mixer", "A_log"), False, (H,), (None,))
            row("mixer.D", ("mixer", "D"), False, (H,), (None,))
            row("mixer.norm.weight", ("mixer", "norm", "scale"), False, (I,), ("norm",))
            row("mixer.out_proj.weight", ("mixer", "out_proj", "kernel"), True, (I, D), (None, "embed"))
        elif kind == ATTENTION:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            row("mixer.q_proj.weight", ("mixer", "q_proj", "kernel"), True, (D, q), ("embed", "heads"))
            row("mixer.k_proj.weight", ("mixer", "k_proj", "kernel"), True, (D, kv), ("embed", "kv_heads"))
            row("mixer.v_proj.weight", ("mixer", "v_proj", "kernel"), True, (D, kv), ("embed", "kv_heads"))
            row("mixer.o_proj.weight", ("mixer", "o_proj", "kernel"), True, (q, D), ("heads", "embed"))
        elif kind == MOE:
            E, F, Fs = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
            Din = cfg.moe_latent_size or D
            din_axis = "embed" if cfg.moe_latent_size is None else None
            # router: fp32 leaves (ROUTER_DTYPE above); the forward routes in fp32 (see route)
            row("mixer.gate.weight", ("mixer", "gate", "kernel"), True, (D, E), ("embed", None), **_FP32_LEAF)
            row("mixer.gate.e_score_correction_bias", ("mixer", "gate", "e_score_correction_bias"), False, (E,),
                (None,), **_FP32_LEAF)
            row("mixer.experts.{e}.up_proj.weight", ("mixer", "experts", "up_proj", "kernel"), True,
                (E, Din, F), ("experts", din_axis, "expert_mlp"))
            row("mixer.experts.{e}.down_proj.weight", ("mixer", "experts", "down_proj", "kernel"), True,
                (E, F, Din), ("experts", "expert_mlp", din_axis))
            row("mixer.shared_experts.up_proj.weight", ("mixer", "shared_experts", "up_proj", "kernel"), True,
                (D, Fs), ("embed", "mlp"))
            row("mixer.shared_experts.down_proj.weight", ("mixer", "shared_experts", "down_proj", "kernel"), True,
                (Fs, D), ("mlp", "embed"))
            if cfg.moe_latent_size is not None:
                row("mixer.fc1_latent_proj.weight", ("mixer", "fc1_latent_proj", "kernel"), True, (D, Din), ("embed", None))
                row("mixer.fc2_latent_proj.weight", ("mixer", "fc2_latent_proj", "kernel"), True, (Din, D), (None, "embed"))
        else:  # MLP
            F = cfg.intermediate_size
            row("mixer.up_proj.weight", ("mixer", "up_proj", "kernel"), True, (D, F), ("embed", "mlp"))
            row("mixer.down_proj.weight", ("mixer", "down_proj", "kernel"), True, (F, D), ("mlp", "embed"))
    specs.append(WeightSpec(f"{pre}.norm_f.weight", ("norm_f", "scale"), False, (D,), ("norm",)))
    specs.append(WeightSpec("lm_head.weight", ("lm_head", "kernel"), True, (D, V), ("embed", "vocab")))
    return specs


# =============================================================================================
# Init (toy targets for tests; abstract shapes for the full-size config via jax.eval_shape)
# =============================================================================================
def init_params(cfg: NemotronHTargetConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params: normal(0, std) matrices, unit norm scales, and Mamba's A_log = log(1..H),
    D = 1, dt_bias = softplus^-1 of steps spread over [0.001, 0.1] (HF's default time_step_min/max).

    All random leaves are cut from one normal draw (one RNG kernel to compile instead of one per
    leaf); jitted, and usable under ``jax.eval_shape`` for the full-size shapes.
    """
    return _init_params_jit(cfg, key, np.dtype(dtype).name, float(std))


def _init_params(cfg: NemotronHTargetConfig, key, dtype: str, std: float) -> dict:
    specs = weight_specs(cfg)
    fixed = ("scale", "D", "A_log", "dt_bias", "e_score_correction_bias", "bias")
    sizes = [0 if spec.path[-1] in fixed else math.prod(spec.shape) for spec in specs]
    noise = std * jax.random.normal(key, (sum(sizes),), jnp.float32)
    params: dict = {}
    H, offset = cfg.mamba_num_heads, 0
    for spec, size in zip(specs, sizes):
        name = spec.path[-1]
        leaf_dtype = getattr(spec, "dtype", None) or dtype  # router rows: fp32
        if name == "scale" or name == "D":
            value = jnp.ones(spec.shape, leaf_dtype)
        elif name == "A_log":
            value = jnp.broadcast_to(jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)), spec.shape).astype(leaf_dtype)
        elif name == "dt_bias":
            lo = 1e-3  # HF's default time_step_min (init range only; not the runtime dt_limit)
            dt = jnp.exp(jnp.linspace(math.log(lo), math.log(0.1), H, dtype=jnp.float32))
            value = jnp.broadcast_to(dt + jnp.log(-jnp.expm1(-dt)), spec.shape).astype(leaf_dtype)
        elif name in fixed:
            value = jnp.zeros(spec.shape, leaf_dtype)
        else:
            value = noise[offset:offset + size].reshape(spec.shape).astype(leaf_dtype)
            offset += size
        tree_set(params, spec.path, value)
    return params


_init_params_jit = jax.jit(_init_params, static_argnums=(0, 2, 3))


# =============================================================================================
# Blocks
# =============================================================================================
def rms_norm_fp32_weight(x, scale, eps):
    """NemotronHRMSNorm: normalise in fp32, multiply by the weight in fp32, then cast to x's dtype
    (fp64 input stays fp64 throughout: the tests' exact references)."""
    acc = accum_dtype(x)
    x32 = x.astype(acc)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (scale.astype(acc) * normed).astype(x.dtype)


def _ffn(p, act: str, x):
    return _ACTIVATIONS[act](x @ p["up_proj"]["kernel"]) @ p["down_proj"]["kernel"]


def route(x_nd, gate: dict, cfg: NemotronHTargetConfig):
    """Nemotron-H / DeepSeek-V3 router, in fp32 at full matmul precision (expert choice is discrete,
    so a low-precision logit could flip it). Returns (expert ids int32 [N, k], weights fp32 [N, k]);
    fp64 inputs route in fp64 (weights fp64)."""
    acc = accum_dtype(x_nd)
    logits = jnp.dot(x_nd.astype(acc), gate["kernel"].astype(acc), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + gate["e_score_correction_bias"].astype(acc)  # bias steers the choice only
    if cfg.n_group > 1:
        n, e = choice.shape
        per = e // cfg.n_group
        group_score = jax.lax.top_k(choice.reshape(n, cfg.n_group, per), 2)[0].sum(-1)  # top-2 sum per group
        _, groups = jax.lax.top_k(group_score, cfg.topk_group)
        keep = jax.nn.one_hot(groups, cfg.n_group, dtype=jnp.bool_).any(axis=1)
        choice = jnp.where(jnp.repeat(keep, per, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * jnp.asarray(cfg.routed_scaling_factor, acc)


def _moe(p, cfg: NemotronHTargetConfig, x_btd):
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)
    ids, weights = route(x, p["gate"], cfg)
    if cfg.moe_latent_size is not None:
        x = x @ p["fc1_latent_proj"]["kernel"]
    routed = moe_experts(
        x, ids, weights, up_edf=p["experts"]["up_proj"]["kernel"], down_efd=p["experts"]["down_proj"]["kernel"],
        activation=cfg.mlp_hidden_act, implementation=cfg.kernels.moe,
    )
    if cfg.moe_latent_size is not None:
        routed = routed @ p["fc2_latent_proj"]["kernel"]
    return routed.reshape(b, t, d) + _ffn(p["shared_experts"], cfg.mlp_hidden_act, x_btd)


def block(kind: str, lp: dict, cfg: NemotronHTargetConfig, x_btd, inputs: StackInputs, cache=None, slot=None):
    """x + mixer(norm(x)) for a block of type ``kind``: (new x, new cache or None). In cached
    decoding ``slot`` is the block's row in its type's cache leaves (the KV cache for attention,
    "conv" / "ssm" for Mamba); MoE and MLP blocks are per token and cache nothing."""
    h = rms_norm_fp32_weight(x_btd, lp["norm"]["scale"], cfg.layer_norm_epsilon)
    mixer = lp["mixer"]
    if kind == MAMBA:
        if cache is None:
            out = mamba2_mixer(mixer, cfg.mamba_dims, h, inputs.segment_ids)
        else:
            out, c, s = mamba2_decode(mixer, cfg.mamba_dims, h, cache["conv"][slot], cache["ssm"][slot], inputs.extra)
            cache = dict(cache, conv=cache["conv"].at[slot].set(c), ssm=cache["ssm"].at[slot].set(s))
    elif kind == ATTENTION:  # GQA with no positional encoding
        kv = None if cache is None else {"k": cache["k"], "v": cache["v"]}
        out, kv = attention_block(mixer, cfg.attention, h, inputs.mask, None, cache=kv, layer=slot,
                                  slots_bt=inputs.slots)
        cache = cache if cache is None else dict(cache, **kv)
    elif kind == MOE:
        out = _moe(mixer, cfg, h)
    else:
        out = _ffn(mixer, cfg.mlp_hidden_act, h)
    return x_btd + out.astype(x_btd.dtype), cache


# =============================================================================================
# Layer schedule: one stack per block type, each layer at its slot in its type's stack
# =============================================================================================
def run_layers(params, cfg: NemotronHTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every block, split at the taps (taps may sit on any block type).

    Training forward: one lax.scan per span over layer indices; each step picks its block type with
    lax.switch (one branch per type present) and reads that type's stack at the layer's slot with
    a dynamic index (in place, no weight copies). Cached decoding runs the blocks unrolled: a block
    updates only its own type's cache leaves at a static slot, which a switch over types could not
    (every branch would have to return the whole cache)."""
    slots = cfg.layer_slots

    def apply(kind):
        stack = params[_PARAM_KEY[kind]]

        def run(carry, slot):
            return block(kind, index_layer(stack, slot), cfg, carry[0], inputs, carry[1], slot)
        return run

    def run_span(carry, start, stop):
        if carry[1] is not None or stop - start == 1:
            for layer in range(start, stop):
                carry = apply(cfg.layer_types[layer])(carry, slots[layer])
            return carry
        kinds = cfg.layer_types[start:stop]
        present = [k for k in BLOCK_TYPES if k in kinds]
        branches = [apply(k) for k in present]
        xs = (np.asarray([present.index(k) for k in kinds], np.int32), np.asarray(slots[start:stop], np.int32))

        def step(carry, ks):
            kind, slot = ks
            if len(branches) == 1:
                return branches[0](carry, slot)
            return jax.lax.switch(kind, branches, carry, slot)

        return layer_scan(step, carry, xs)

    return tap_split(run_span, carry, cfg.num_hidden_layers, aux_ids)


def final_norm(params: dict, cfg: NemotronHTargetConfig, x_btd):
    return rms_norm_fp32_weight(x_btd, params["norm_f"]["scale"], cfg.layer_norm_epsilon)


def forward_inputs(cfg: NemotronHTargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    """``positions`` is unused (no positional encoding). ``segment_ids`` [B,T] (0 = padding; default
    one segment per row): attention is causal within a segment, and the Mamba conv window and SSM
    state restart at every segment start."""
    if segment_ids is None:
        segment_ids = jnp.ones(input_ids_bt.shape, jnp.int32)
    mask = segment_causal_mask(segment_ids) if ATTENTION in cfg.layer_types else None
    return StackInputs(mask, None, segment_ids=segment_ids)


# =============================================================================================
# Cached decoding (generation, regeneration, speculative decoding)
# =============================================================================================
# Same contract as every target's (decoder.Decoder.decode_chunk; rollback = the next chunk starts
# at a smaller slot). Attention blocks share a KV cache {"k", "v"} [La,B,S,Hkv,D] (no RoPE); MoE /
# MLP blocks are per token; Mamba blocks keep "conv" [Lm,B,S,conv_dim] (every slot's pre-conv
# input, so the conv window of any restart point is still there) and "ssm" [Lm,B,W,H,P,N] fp32 with
# "ssm_slot" [B,W]: the SSM states after the last chunk's rows, labelled by slot, W =
# config.decode_state_window (layers/mamba2.py "Cached decoding"). A state per slot for the whole
# sequence would be H*P*N floats per slot per Mamba layer (2 MiB fp32 at the Nano shape).
def init_cache(cfg: NemotronHTargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed cache for `max_len` slots per row (rounded up by ``layers.attention.cache_size_for``)."""
    cache = decoding.init_kv_cache(len(cfg.layers_of(ATTENTION)), batch_size, max_len, cfg.num_key_value_heads,
                                   cfg.head_dim, dtype)
    m, lm, w = cfg.mamba_dims, len(cfg.layers_of(MAMBA)), cfg.decode_state_window
    num_slots = cache["k"].shape[2]
    cache["conv"] = jnp.zeros((lm, batch_size, num_slots, m.conv_dim), dtype)
    cache["ssm"] = jnp.zeros((lm, batch_size, w, m.num_heads, m.head_dim, m.state_size), jnp.float32)
    cache["ssm_slot"] = jnp.full((batch_size, w), EMPTY_LABEL, jnp.int32)
    return cache


def decode_inputs(cfg: NemotronHTargetConfig, cache: dict, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                  valid_from_b, logits_index, dtype):
    """A chunk's cache mask and write slots (no RoPE) and the Mamba-2 plan: a chunk continues from the
    state after slot start-1, and the SSM states after its rows are kept for the next chunk
    (mamba2.decode_chunk_plan; a tree chunk needs ``decode_state_window`` >= T). Returns
    (StackInputs, the cache with the new state labels)."""
    start_b, mask, slots = decoding.chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b,
                                                 cfg.attention)
    plan = None
    if cfg.has_mamba:
        plan = decode_chunk_plan(cfg.conv_kernel, cache["ssm_slot"], start_b, chunk_mask_btt, valid_from_b,
                                 logits_index, t=input_ids_bt.shape[1])
        cache = dict(cache, ssm_slot=plan.labels)
    return StackInputs(mask, None, slots=slots, extra=plan), cache


DECODER = Decoder(run_layers, embedding=("embeddings", "embedding"), final_norm=final_norm,
                  forward_inputs=forward_inputs, decode_inputs=decode_inputs, init_cache=init_cache)
forward, decode_chunk = DECODER.forward, DECODER.decode_chunk


def commit_path(cache: dict, start, path, accepted) -> dict:
    """Tree verification's commit (targets.base.commit_tree_path, batch row 0): the K/V and conv
    inputs of the accepted nodes move to the linear slots start+1..start+accepted, and the window's
    state after node path[i] is re-labelled slot start+i (other nodes' states are dropped), so the
    next chunk resumes from the accepted path's state."""
    moved = commit_tree_path({"k": cache["k"], "v": cache["v"], "conv": cache["conv"]}, start, path, accepted)
    labels = cache["ssm_slot"][0]
    i = jnp.arange(path.shape[0])
    on_path = ((labels - start)[:, None] == path[None, :]) & (i[None, :] <= accepted)  # [W, depth+1]
    keep = jnp.where(labels == start - 1, labels, EMPTY_LABEL)  # the state before the chunk stays valid
    relabelled = jnp.where(jnp.any(on_path, axis=1), start + jnp.argmax(on_path, axis=1), keep).astype(jnp.int32)
    return dict(moved, ssm=cache["ssm"], ssm_slot=cache["ssm_slot"].at[0].set(relabelled))


# =============================================================================================
# Draft compatibility
# =============================================================================================
def check_draft_compat(target_config: NemotronHTargetConfig | Mapping[str, Any], draft_num_kv_heads: int | None) -> None:
    """Raise unless an EAGLE-3 draft with ``draft_num_kv_heads`` KV heads can be served with this target.

    vLLM sizes one KV-cache page for the whole hybrid model; for a target with Mamba layers it cannot
    reconcile a draft whose KV-head count differs from the target's (it fails in
    ``unify_kv_cache_spec_page_size``, and no runtime flag fixes it: the Nemotron 3.5 Lightning
    EAGLE-3 card, §8). ``None`` means "copy the target's", which is always fine.
    """
    if isinstance(target_config, Mapping):
        target_config = NemotronHTargetConfig.from_hf(target_config)
    if draft_num_kv_heads is None or not target_config.has_mamba:
        return
    want = target_config.num_key_value_heads
    if int(draft_num_kv_heads) != want:
        raise ValueError(
            f"draft num_key_value_heads={draft_num_kv_heads} does not match the target's "
            f"num_key_value_heads={want}. For a hybrid Mamba target (Nemotron-H) vLLM cannot unify the "
            f"KV-cache page size of a draft with a different KV-head count, and serving fails. "
            f"Fix: set draft.num_key_value_heads={want} (or leave it unset to copy the target's)."
        )


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCHITECTURE)  # hybrid Mamba-2 / attention / MoE / MLP blocks
class NemotronHTarget(Target):
    """Frozen Nemotron-H target (see module docstring)."""

    config_class = NemotronHTargetConfig
    decoder = DECODER
    commit_path_fn = staticmethod(commit_path)  # tree verification: re-label the accepted path's SSM states
    weight_specs = staticmethod(weight_specs)
    init_params = staticmethod(init_params)

    @classmethod
    def ignored_hf_names(cls, config: NemotronHTargetConfig, name: str) -> bool:
        return name.startswith("mtp.")  # multi-token-prediction head; transformers ignores it too

    @classmethod
    def check_draft_compat(cls, config: NemotronHTargetConfig, draft_num_kv_heads: int | None) -> None:
        check_draft_compat(config, draft_num_kv_heads)

    # Nemotron 3 Nano 30B-A3B: 3.6 B active of 31.6 B
    routed_experts_path = ("moe", "mixer", "experts")

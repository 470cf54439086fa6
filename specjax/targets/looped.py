"""Looped (weight-shared) frozen targets: the decoder stack, or a span of it, runs several times.

Aux layer ids of a looped target address the unrolled **virtual depth** Lv (every layer
application counts once, output-of-virtual-layer-k convention), e.g. [2, 22, 40] on 22 layers x 2
loops (Lv = 44), which the export writes as vLLM's [3, 23, 41], the key the Nanbeige4.2-3B EAGLE-3
card gives; the default is [1, Lv//2-1, Lv-4]. The
training target (final_hidden) is the state after the last virtual layer and the final norm.
Each forward walks a static list of physical layer ids (the unroll) with one ``lax.scan`` per span
between aux taps, so only the tapped states are kept.

Two architectures, read top to bottom:

1. ``LoopedLlamaForCausalLM`` / ``LoopedQwen3ForCausalLM`` (specjax's generic looped Llama).
   A Llama or Qwen3 checkpoint (same tensors on disk) whose config.json adds the loop fields::

       "architectures": ["LoopedLlamaForCausalLM"],   # or LoopedQwen3ForCausalLM (q/k norm)
       "model_type": "llama",                          # the base family's, so transformers reads it
       "num_hidden_layers": 22,                        # physical layers = tensors on disk
       "num_loops": 2,                                 # passes over the looped span (>= 1)
       "loop_start": 0, "loop_end": 22                 # optional span [loop_start, loop_end)

   Unroll: layers [0, loop_start), then [loop_start, loop_end) num_loops times, then
   [loop_end, L). Lv = L + (num_loops - 1) * (loop_end - loop_start). Positions, RoPE and the
   segment mask are the same on every pass; the final norm runs once at the end.

2. ``HrmTextForCausalLM`` (transformers' HRM-Text, Sapient). Two stacks of Llama-style blocks
   (weightless RMSNorms, MHA with a sigmoid output gate per head dim, SwiGLU MLP), the L(ow) and
   the H(igh) module, each ending in a weightless RMSNorm. With x = embed(ids) * embedding_scale,
   z_H = x and z_L = z_L_init:  for each of H_cycles:  L_cycles times z_L = L(z_L + z_H);  then
   z_H = H(z_H + z_L).  Logits = lm_head(z_H). Virtual depth = n * H_cycles * (L_cycles + 1) with
   n = num_layers_per_stack, which is exactly HF's (inflated) ``num_hidden_layers``; virtual layer
   v is layer v % n of stack invocation v // n. The aux state at v is the output of that block
   (before the stack's closing norm). On disk HRM fuses projections ([gate; q; k; v] as
   ``attn.gqkv_proj`` and [gate; up] as ``mlp.gate_up_proj``); the weight map reads each chunk into
   its own leaf. The prefix-LM option (bidirectional attention over ``token_type_ids == 1``) is not
   used: targets see token ids only, which HF also treats as plain causal attention.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from specjax.targets import llama
from specjax.targets.base import split_at_taps, Target, WeightSpec, validate_aux_layer_ids
from specjax.targets.layers.attention import dot_product_attention
from specjax.targets.layers.mlp import swiglu_mlp
from specjax.targets.layers.norms import rms_norm
from specjax.targets.layers.rope import RopeSpec, apply_rope, rope_spec_from_hf

# looped architecture name -> the dense architecture whose layers it loops
LOOPED_LLAMA_ARCHS = {"LoopedLlamaForCausalLM": "LlamaForCausalLM", "LoopedQwen3ForCausalLM": "Qwen3ForCausalLM"}
HRM_ARCH = "HrmTextForCausalLM"


def _index(tree, i):
    """Layer i of a stacked subtree, read in place (dynamic index, no copy of the stack)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), tree)


# =============================================================================================
# 1. Generic looped Llama / Qwen3
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class LoopedLlamaConfig(llama.LlamaTargetConfig):
    """A LlamaTargetConfig (physical layers, as on disk) plus the loop: span [loop_start, loop_end)
    runs ``num_loops`` times. ``architecture`` is the looped name."""

    num_loops: int = 1
    loop_start: int = 0
    loop_end: int = -1  # -1 -> num_hidden_layers (set by from_hf)

    @property
    def base_architecture(self) -> str:
        return LOOPED_LLAMA_ARCHS[self.architecture]

    @property
    def qk_norm(self) -> bool:
        return self.base_architecture == "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return llama._MODEL_TYPES[self.base_architecture]

    @property
    def num_virtual_layers(self) -> int:
        return self.num_hidden_layers + (self.num_loops - 1) * (self.loop_end - self.loop_start)

    def virtual_layers(self) -> tuple[int, ...]:
        """Physical layer id of each virtual layer (length num_virtual_layers)."""
        span = tuple(range(self.loop_start, self.loop_end))
        head, tail = tuple(range(self.loop_start)), tuple(range(self.loop_end, self.num_hidden_layers))
        return head + span * self.num_loops + tail

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "LoopedLlamaConfig":
        if not isinstance(hf, Mapping) and hasattr(hf, "to_dict"):
            hf = hf.to_dict()
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in LOOPED_LLAMA_ARCHS:
            raise ValueError(
                f"LoopedLlamaConfig handles {sorted(LOOPED_LLAMA_ARCHS)} (config.json 'architectures'), got {arch!r}"
            )
        loop = {k: overrides.pop(k, hf.get(k)) for k in ("num_loops", "loop_start", "loop_end")}
        if loop["num_loops"] is None:
            raise ValueError(f"{arch} config.json needs 'num_loops' (how many times the looped span runs)")
        base = llama.LlamaTargetConfig.from_hf({**hf, "architectures": [LOOPED_LLAMA_ARCHS[arch]]}, **overrides)
        L = base.num_hidden_layers
        num_loops = int(loop["num_loops"])
        start = 0 if loop["loop_start"] is None else int(loop["loop_start"])
        end = L if loop["loop_end"] is None else int(loop["loop_end"])
        if num_loops < 1:
            raise ValueError(f"{arch}: num_loops={num_loops} must be >= 1")
        if not 0 <= start < end <= L:
            raise ValueError(
                f"{arch}: loop span [loop_start, loop_end) = [{start}, {end}) must satisfy "
                f"0 <= loop_start < loop_end <= num_hidden_layers={L}"
            )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return cls(**{**fields, "architecture": arch, "num_loops": num_loops, "loop_start": start, "loop_end": end})

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        base = dataclasses.replace(self, architecture=self.base_architecture)
        d = llama.LlamaTargetConfig.to_hf(base, dtype)
        d.update(architectures=[self.architecture], num_loops=self.num_loops,
                 loop_start=self.loop_start, loop_end=self.loop_end)
        return d


def looped_llama_weight_specs(cfg: LoopedLlamaConfig) -> list[WeightSpec]:
    """Exactly the Llama / Qwen3 tensors: the loop reuses the physical layers' weights."""
    return llama.weight_specs(cfg)


def _run_virtual(layers: dict, cfg: LoopedLlamaConfig, x_btd, phys_ids: Sequence[int], cos, sin, mask):
    """Apply the Llama decoder layers ``phys_ids`` in order with one scan over the (static) ids."""
    if not phys_ids:
        return x_btd

    def body(x, i):
        return llama._decoder_layer(_index(layers, i), cfg, x, cos, sin, mask), None

    x_btd, _ = jax.lax.scan(body, x_btd, jnp.asarray(phys_ids, jnp.int32))
    return x_btd


def looped_llama_forward(
    params: dict,
    cfg: LoopedLlamaConfig,
    input_ids_bt: jax.Array,
    *,
    aux_layer_ids: Sequence[int] = (),
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    """Pure forward: (final_hidden after the last virtual layer and the final norm, aux tuple)."""
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_virtual_layers)
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    mask, cos, sin = llama.attention_inputs(cfg, input_ids_bt.shape, positions, segment_ids, x.dtype)

    unroll = cfg.virtual_layers()
    aux = []
    for a, b_, tapped in split_at_taps(0, len(unroll), aux_ids):
        x = _run_virtual(params["layers"], cfg, x, unroll[a:b_], cos, sin, mask)
        if tapped:
            aux.append(x)
    return rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps), tuple(aux)


class LoopedLlamaTarget(Target):
    """Frozen looped Llama / Qwen3 target (see module docstring, part 1)."""

    config_class = LoopedLlamaConfig
    forward_fn = staticmethod(looped_llama_forward)
    embed_fn = staticmethod(llama.embed_table)
    lm_head_fn = staticmethod(llama.lm_head_weight)

    @classmethod
    def weight_specs(cls, config: LoopedLlamaConfig) -> list[WeightSpec]:
        return looped_llama_weight_specs(config)


# =============================================================================================
# 2. HRM-Text (transformers' HrmTextForCausalLM)
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class HrmTextTargetConfig:
    """Hashable subset of HF's HrmTextConfig. ``num_hidden_layers`` is the virtual depth, as in HF."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers_per_stack: int
    num_attention_heads: int
    head_dim: int
    H_cycles: int
    L_cycles: int
    embedding_scale: float
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rope: RopeSpec = RopeSpec()
    attention_q_block: int = 0  # runtime option, see LlamaTargetConfig
    attention_implementation: str = "auto"  # runtime option, see LlamaTargetConfig

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads  # HRM attention is MHA

    @property
    def num_invocations(self) -> int:
        """Stack runs per forward: each H cycle runs L L_cycles times, then H once."""
        return self.H_cycles * (self.L_cycles + 1)

    @property
    def num_virtual_layers(self) -> int:
        return self.num_layers_per_stack * self.num_invocations

    @property
    def num_hidden_layers(self) -> int:
        return self.num_virtual_layers  # HF stores this inflated count in config.json too

    def invocations(self) -> list[str]:
        """"L_module" / "H_module" for each stack run, in execution order."""
        one_cycle = ["L_module"] * self.L_cycles + ["H_module"]
        return one_cycle * self.H_cycles

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "HrmTextTargetConfig":
        if not isinstance(hf, Mapping) and hasattr(hf, "to_dict"):
            hf = hf.to_dict()
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else ("HrmTextForCausalLM" if hf.get("model_type") == "hrm_text" else None)
        if arch != HRM_ARCH:
            raise ValueError(f"HrmTextTargetConfig handles {HRM_ARCH}, got architecture {arch!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{arch} with {flag}=true is not supported by specjax targets")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        H, Lc = int(hf.get("H_cycles", 2)), int(hf.get("L_cycles", 3))
        if H < 1 or Lc < 1:
            raise ValueError(f"{arch}: H_cycles={H} and L_cycles={Lc} must both be >= 1")
        # transformers rewrites num_hidden_layers to the virtual count and keeps the per-stack depth
        # in num_layers_per_stack; a config without the latter carries the per-stack depth itself.
        n = hf.get("num_layers_per_stack")
        n = int(n) if n is not None else int(hf["num_hidden_layers"])
        if hf.get("num_layers_per_stack") is not None and int(hf["num_hidden_layers"]) != n * H * (Lc + 1):
            raise ValueError(
                f"{arch}: num_hidden_layers={hf['num_hidden_layers']} should be num_layers_per_stack * H_cycles * "
                f"(L_cycles + 1) = {n * H * (Lc + 1)}"
            )
        heads = int(hf["num_attention_heads"])
        scale = hf.get("embedding_scale")
        if scale is None:
            scale = 1.0 / float(hf.get("initializer_range", 0.02))
        kw = dict(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers_per_stack=n,
            num_attention_heads=heads,
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            H_cycles=H,
            L_cycles=Lc,
            embedding_scale=float(scale),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rope=rope_spec_from_hf(hf),
        )
        kw.update(overrides)
        return cls(**kw)


def hrm_weight_specs(cfg: HrmTextTargetConfig) -> list[WeightSpec]:
    n, D, F, V = cfg.num_layers_per_stack, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    specs = [WeightSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), False, (V, D), ("vocab", "embed")),
             WeightSpec("model.z_L_init", ("z_L_init",), False, (D,), ("norm",))]
    for stack in ("L_module", "H_module"):
        p = f"model.{stack}.layers.{{i}}."
        rows = [
            # hf name (fused on disk)    chunk    specjax path                             shape       logical axes
            ("attn.gqkv_proj.weight",    (0, 4),  ("self_attn", "gate_proj", "kernel"),    (n, D, q),  ("layers", "embed", "heads")),
            ("attn.gqkv_proj.weight",    (1, 4),  ("self_attn", "q_proj", "kernel"),       (n, D, q),  ("layers", "embed", "heads")),
            ("attn.gqkv_proj.weight",    (2, 4),  ("self_attn", "k_proj", "kernel"),       (n, D, q),  ("layers", "embed", "heads")),
            ("attn.gqkv_proj.weight",    (3, 4),  ("self_attn", "v_proj", "kernel"),       (n, D, q),  ("layers", "embed", "heads")),
            ("attn.o_proj.weight",       None,    ("self_attn", "o_proj", "kernel"),       (n, q, D),  ("layers", "heads", "embed")),
            ("mlp.gate_up_proj.weight",  (0, 2),  ("mlp", "gate_proj", "kernel"),          (n, D, F),  ("layers", "embed", "mlp")),
            ("mlp.gate_up_proj.weight",  (1, 2),  ("mlp", "up_proj", "kernel"),            (n, D, F),  ("layers", "embed", "mlp")),
            ("mlp.down_proj.weight",     None,    ("mlp", "down_proj", "kernel"),          (n, F, D),  ("layers", "mlp", "embed")),
        ]
        for name, chunk, path, shape, axes in rows:
            specs.append(WeightSpec(p + name, (stack, "layers") + path, True, shape, axes,
                                    layer_ids=tuple(range(n)), hf_chunk=chunk))
    if not cfg.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", ("lm_head", "kernel"), True, (D, V), ("embed", "vocab")))
    return specs


def _unit_rms_norm(x, eps):
    """HRM's RMSNorm has no weight (normalise in fp32, cast back)."""
    return rms_norm(x, jnp.ones((), x.dtype), eps)


def _hrm_block(lp: dict, cfg: HrmTextTargetConfig, x_btd, cos, sin, mask):
    b, t, _ = x_btd.shape
    attn = lp["self_attn"]
    h = _unit_rms_norm(x_btd, cfg.rms_norm_eps)
    heads = (b, t, cfg.num_attention_heads, cfg.head_dim)
    q = apply_rope((h @ attn["q_proj"]["kernel"]).reshape(heads), cos, sin)
    k = apply_rope((h @ attn["k_proj"]["kernel"]).reshape(heads), cos, sin)
    v = (h @ attn["v_proj"]["kernel"]).reshape(heads)
    gate = jax.nn.sigmoid((h @ attn["gate_proj"]["kernel"]).reshape(heads))
    o = gate * dot_product_attention(q, k, v, mask, scale=cfg.head_dim**-0.5, q_block=cfg.attention_q_block,
                                     implementation=cfg.attention_implementation)
    x_btd = x_btd + o.reshape(b, t, -1) @ attn["o_proj"]["kernel"]
    h = _unit_rms_norm(x_btd, cfg.rms_norm_eps)
    mlp = lp["mlp"]
    return x_btd + swiglu_mlp(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])


def _run_stack_layers(layers: dict, cfg: HrmTextTargetConfig, x_btd, start: int, stop: int, cos, sin, mask):
    if stop <= start:
        return x_btd

    def body(x, i):
        return _hrm_block(_index(layers, i), cfg, x, cos, sin, mask), None

    x_btd, _ = jax.lax.scan(body, x_btd, jnp.arange(start, stop, dtype=jnp.int32))
    return x_btd


def hrm_forward(
    params: dict,
    cfg: HrmTextTargetConfig,
    input_ids_bt: jax.Array,
    *,
    aux_layer_ids: Sequence[int] = (),
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    """Pure forward: (final z_H after the last H stack's norm, aux tuple over virtual depth)."""
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_virtual_layers)
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0) * cfg.embedding_scale
    mask, cos, sin = llama.attention_inputs(cfg, input_ids_bt.shape, positions, segment_ids, x.dtype)

    n = cfg.num_layers_per_stack
    z = {"H_module": x, "L_module": jnp.broadcast_to(params["z_L_init"].astype(x.dtype), x.shape)}
    other = {"L_module": "H_module", "H_module": "L_module"}
    aux = []
    for j, stack in enumerate(cfg.invocations()):
        h = z[stack] + z[other[stack]]  # input injection: the other state is added on entry
        for a, b_, tapped in split_at_taps(j * n, (j + 1) * n, aux_ids):
            h = _run_stack_layers(params[stack]["layers"], cfg, h, a - j * n, b_ - j * n, cos, sin, mask)
            if tapped:
                aux.append(h)
        z[stack] = _unit_rms_norm(h, cfg.rms_norm_eps)
    return z["H_module"], tuple(aux)


class HrmTextTarget(Target):
    """Frozen HRM-Text target (see module docstring, part 2)."""

    config_class = HrmTextTargetConfig
    forward_fn = staticmethod(hrm_forward)
    embed_fn = staticmethod(llama.embed_table)
    lm_head_fn = staticmethod(llama.lm_head_weight)

    @classmethod
    def weight_specs(cls, config: HrmTextTargetConfig) -> list[WeightSpec]:
        return hrm_weight_specs(config)


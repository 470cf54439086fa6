"""HRM-Text frozen target (``HrmTextForCausalLM``, transformers' HRM-Text by Sapient) in plain JAX.

Read top to bottom: config -> HF weight map -> block and the H/L cycles -> Target class (embedding,
RoPE, logits and cached decoding: the shared skeleton, decoder.py).

Two stacks of Llama-style blocks (weightless RMSNorms, MHA with a sigmoid output gate per head dim,
SwiGLU MLP), the L(ow) and the H(igh) module, each ending in a weightless RMSNorm. With
x = embed(ids) * embedding_scale, z_H = x and z_L = z_L_init:  for each of H_cycles:  L_cycles
times z_L = L(z_L + z_H);  then z_H = H(z_H + z_L).  Logits = lm_head(z_H).

A looped target: aux layer ids address the unrolled **virtual depth** n * H_cycles * (L_cycles + 1)
with n = num_layers_per_stack, which is exactly HF's (inflated) ``num_hidden_layers``; virtual
layer v is layer v % n of stack invocation v // n. The aux state at v is the output of that block
(before the stack's closing norm); one ``lax.scan`` per span between taps, so only the tapped
states are kept.

On disk HRM fuses projections ([gate; q; k; v] as ``attn.gqkv_proj`` and [gate; up] as
``mlp.gate_up_proj``); the weight map reads each chunk into its own leaf. The prefix-LM option
(bidirectional attention over ``token_type_ids == 1``) is not used: targets see token ids only,
which HF also treats as plain causal attention.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, rope_spec_from_hf
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, attention_ffn_block, swiglu
from specjax.targets.hf_keys import attention_keys, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers.attention import AttentionConfig
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.registry import model_type_of, register

HRM_ARCH = "HrmTextForCausalLM"
# config.json keys -> config fields; HRM attention is MHA, so num_key_value_heads is not read
# (the stack depth, cycles and embedding scale: HrmTextTargetConfig.from_hf; rope: layers/rope.py)
HF_KEYS = tuple(row for row in attention_keys(max_position_embeddings=2048) if row.key != "num_key_value_heads")


# =============================================================================================
# Config
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
    kernels: KernelChoices = KernelChoices()  # runtime option, not part of the HF config

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads  # HRM attention is MHA

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig.of(self, output_gate=True)

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
        hf, arch = resolve_hf_config(hf, (HRM_ARCH,), "HrmTextTargetConfig",
                                     unsupported_flags=("attention_bias", "mlp_bias"), silu_keys=("hidden_act",))
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
        scale = hf.get("embedding_scale")
        if scale is None:
            scale = 1.0 / float(hf.get("initializer_range", 0.02))
        kw = dict(architecture=arch, num_layers_per_stack=n, H_cycles=H, L_cycles=Lc, embedding_scale=float(scale),
                  rope=rope_spec_from_hf(hf), **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        return cls(**kw)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read;
        num_hidden_layers is the virtual count, as transformers writes it."""
        return {"architectures": [self.architecture], "model_type": model_type_of(self.architecture), "dtype": dtype,
                **hf_values(HF_KEYS, self), "num_hidden_layers": self.num_hidden_layers,
                "num_layers_per_stack": self.num_layers_per_stack, "H_cycles": self.H_cycles,
                "L_cycles": self.L_cycles, "embedding_scale": self.embedding_scale,
                "rope_parameters": self.rope.to_hf(), "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False}


# =============================================================================================
# HF weight map (fused tensors on disk: each chunk becomes its own leaf)
# =============================================================================================
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


# =============================================================================================
# Block and schedule (the H/L cycles)
# =============================================================================================
def _unit_rms_norm(x, eps):
    """HRM's RMSNorm has no weight (normalise in fp32, cast back)."""
    return rms_norm(x, jnp.ones((), x.dtype), eps)


def hrm_block(lp: dict, cfg: HrmTextTargetConfig, x_btd, inputs: StackInputs, cache=None, layer=None):
    """x + gated attn(norm(x)), then + SwiGLU(norm(x)), both norms weightless: (new x, new cache or None)."""
    unit = jnp.ones((), x_btd.dtype)
    return attention_ffn_block(lp["self_attn"], cfg, x_btd, inputs, (unit, unit), swiglu(lp["mlp"]), cache, layer)


def run_cycles(params: dict, cfg: HrmTextTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """The H/L cycles from the scaled embeddings: ((final z_H after its stack's norm, cache), aux).
    Virtual layer v = j * n + i (layer i of stack invocation j) taps aux id v and uses cache row v.
    The taps split each invocation's scan; the stack itself is not one tap-split scan, since the
    state entering each invocation is the sum of the two carried states (input injection)."""
    x_btd, cache = carry
    n = cfg.num_layers_per_stack
    z = {"H_module": x_btd, "L_module": jnp.broadcast_to(params["z_L_init"].astype(x_btd.dtype), x_btd.shape)}
    other = {"L_module": "H_module", "H_module": "L_module"}
    aux = []
    for j, stack in enumerate(cfg.invocations()):
        layers = params[stack]["layers"]

        def step(carry, layer, layers=layers):
            (h, c), (i, v) = carry, layer
            return hrm_block(index_layer(layers, i), cfg, h, inputs, c, v)

        h = z[stack] + z[other[stack]]  # input injection: the other state is added on entry
        taps = [k - j * n for k in aux_ids]  # virtual ids of this invocation -> its layer ids
        xs = (np.arange(n, dtype=np.int32), j * n + np.arange(n, dtype=np.int32))
        (h, cache), tapped = scan_layers(step, (h, cache), xs, taps, tapped=lambda carry: carry[0])
        aux.extend(tapped)
        z[stack] = _unit_rms_norm(h, cfg.rms_norm_eps)
    return (z["H_module"], cache), tuple(aux)


def _scale_embeddings(cfg: HrmTextTargetConfig, x):
    return x * cfg.embedding_scale


# Cached decoding: every block attends causally over the sequence (the prefix-LM option is unused),
# and z_L / z_H of a token depend on earlier tokens only through those attentions, so each stack
# invocation's layer has a well-defined K/V per token: a KV cache row per virtual layer.
DECODER = Decoder(run_cycles, scale_embeddings=_scale_embeddings, final_norm=None)  # z_H ends in its stack's norm


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(HRM_ARCH)  # H/L stacks, H_cycles x L_cycles; aux ids address the unrolled virtual depth
class HrmTextTarget(Target):
    """Frozen HRM-Text target (see module docstring)."""

    config_class = HrmTextTargetConfig
    decoder = DECODER
    weight_specs = staticmethod(hrm_weight_specs)

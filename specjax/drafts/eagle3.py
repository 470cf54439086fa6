"""The EAGLE-3 draft head: fc over three target aux states, one Llama decoder layer whose q/k/v read
[input_layernorm(embedding), hidden_norm(h)] (2H wide, embedding first), a final norm, and an
lm_head over the draft vocab (docs/eagle3-format.md, "The draft network" and "TTT training semantics").

Parameters are a plain pytree whose leaves are the rows of specjax.drafts.weights.EAGLE3_WEIGHTS
(also docs/INTERFACES.md); every function here is pure. The token embedding is the target's
(frozen) and is passed in as an array.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import mesh as meshlib
from specjax.drafts import weights
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, apply_rope, rope_tables
from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.ttt_attention import ttt_attention
from specjax_kernels.ttt_attention.context_parallel import ttt_attention_context_parallel


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H, must equal the target's embedding width
    target_hidden_size: int  # tH, width of each aux state
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V, the target's config vocab
    draft_vocab_size: int  # Vd
    aux_layer_ids: tuple[int, ...]  # output-of-layer-k convention
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = RopeSpec()  # the target's RoPE (the draft's positions are the target's)
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    # EAGLE-3.1 options (off = plain EAGLE-3; vLLM/SGLang 2026 meaning;
    # docs/eagle3-format.md, "EAGLE-3.1 flags (fc_norm, norm_output)"):
    fc_norm: bool = False  # one RMSNorm per aux chunk before fc (params fc_norm.{i}.scale, [tH] each)
    norm_output: bool = False  # feed norm(h_out) instead of the pre-norm h_out to the next draft step
    # decoder layers (draft.num_layers): layer 0 reads [input_layernorm(e), hidden_norm(h)]; layers
    # 1..N-1 are plain Llama layers over its output (docs/eagle3-format.md, "Multi-layer heads")
    num_layers: int = 1
    # P-EAGLE (draft.type p_eagle): all K draft tokens come from one forward; the rows of the
    # positions not yet drafted read the embedding of `mask_token_id` and fc(mask_hidden)
    # (docs/eagle3-format.md, "P-EAGLE (parallel drafting)")
    parallel_drafting: bool = False
    mask_token_id: Optional[int] = None
    # draft.train_embedding: the draft owns a [V, H] copy of the target's token embedding (param
    # embed_tokens.embedding, started from the target's) and trains it; exported as embed_tokens.weight
    train_embedding: bool = False

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"draft num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}."
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft.draft_vocab_size={self.draft_vocab_size} is larger than the target vocab "
                f"({self.vocab_size}); set draft.draft_vocab_size <= {self.vocab_size}."
            )
        if self.hidden_act != "silu":
            raise ValueError(f"draft hidden_act {self.hidden_act!r}: only 'silu' is supported.")
        if self.num_layers < 1:
            raise ValueError(f"draft num_layers={self.num_layers} must be >= 1.")
        if self.parallel_drafting:
            if self.mask_token_id is None or not 0 <= int(self.mask_token_id) < self.vocab_size:
                raise ValueError(
                    f"P-EAGLE draft: mask_token_id={self.mask_token_id!r} must be a target token id in "
                    f"[0, {self.vocab_size}); set draft.mask_token_id.")
            if self.norm_output:
                raise ValueError("P-EAGLE draft: norm_output changes what the next sequential draft step reads, "
                                 "and P-EAGLE has no sequential step; set draft.norm_output=false.")
        elif self.mask_token_id is not None:
            raise ValueError(f"draft mask_token_id={self.mask_token_id} is only used by P-EAGLE heads "
                             "(draft.type p_eagle); remove it.")


def init_params(table, cfg, key: jax.Array, *, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random init of a draft from its weight table (specjax.drafts.weights) like HF `post_init`:
    normal(0, std) for the "normal" rows (drawn in fp32, then cast), ones for the "ones" rows,
    normal(0, 1) for the "standard_normal" ones.

    The rows that always exist draw from `jax.random.split(key, n)` in table order; the optional
    ones (`when`) are built after them (a "normal" one from `fold_in(key, n + j)`), so a flag never
    changes the other leaves' values."""
    leaves = weights.entries(table, cfg)
    always = [e.path for e in leaves if e.row.init == "normal" and e.row.when is None]
    keys = dict(zip(always, jax.random.split(key, len(always))))
    out = []
    for e in leaves:
        if e.row.init == "ones":
            out.append((e.path, jnp.ones(e.shape, dtype)))
            continue
        if e.path not in keys:
            keys[e.path] = jax.random.fold_in(key, len(keys))
        scale = 1.0 if e.row.init == "standard_normal" else std
        out.append((e.path, (scale * jax.random.normal(keys[e.path], e.shape, jnp.float32)).astype(dtype)))
    return weights.nest(out)


def init_draft_params(cfg: Eagle3Config, key: jax.Array, *, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random init of the EAGLE-3 draft (weights.EAGLE3_WEIGHTS); all trainable. fc_norm.{i} (ones)
    come after the draws, so the other leaves equal the plain draft's."""
    return init_params(weights.EAGLE3_WEIGHTS, cfg, key, std=std, dtype=dtype)


def param_logical_axes(cfg: Eagle3Config) -> dict:
    """Logical axes for every draft leaf (see specjax.mesh.RULES), from weights.EAGLE3_WEIGHTS."""
    return weights.logical_axes(weights.EAGLE3_WEIGHTS, cfg)


def _mm(x, p):
    return jnp.einsum("...i,io->...o", x, p["kernel"].astype(x.dtype))


def project_aux(params: dict, aux_hidden: tuple | list, cfg: Eagle3Config, dtype=jnp.float32) -> jnp.ndarray:
    """fc(concat(aux_low, aux_mid, aux_high)) -> [B, T, H]; with cfg.fc_norm each chunk is
    RMS-normalised first (EAGLE-3.1, as vLLM's combine_hidden_states / SGLang / SpecForge do)."""
    if len(aux_hidden) != cfg.num_aux:
        raise ValueError(f"expected {cfg.num_aux} aux hidden states, got {len(aux_hidden)}")
    chunks = [a.astype(dtype) for a in aux_hidden]
    if cfg.fc_norm:
        chunks = [rms_norm(a, params["fc_norm"][str(i)]["scale"].astype(dtype), cfg.rms_norm_eps)
                  for i, a in enumerate(chunks)]
    g = jnp.concatenate(chunks, axis=-1)
    return _mm(g, params["fc"])


def mask_hidden_projected(params: dict, cfg: Eagle3Config, dtype=jnp.float32) -> jnp.ndarray:
    """fc(mask_hidden) [H]: what every P-EAGLE row of depth >= 1 reads as its hidden input (vLLM
    computes the same once at load time, through the same fc_norm + fc)."""
    mh = params["mask_hidden"].reshape(1, 1, -1).astype(dtype)
    return project_aux(params, tuple(jnp.split(mh, cfg.num_aux, axis=-1)), cfg, dtype)[0, 0]


def _ttt_attention_cp(q, k0, v0, kd, vd, segment_ids_bt, mesh):
    """The context-parallel TTT attention on the active mesh (batch and heads as the rules say;
    heads stay whole when the GQA groups do not split evenly over `tensor`)."""
    meshlib.check_context_divides(q.shape[1], mesh, "draft TTT attention")
    q_spec = meshlib.spec_for(q.shape, ("batch", "seq", "heads", None), mesh)
    kv_spec = meshlib.spec_for(k0.shape, ("batch", "seq", "kv_heads", None), mesh)
    if (q_spec[2] is None) != (kv_spec[2] is None):
        q_spec, kv_spec = P(*q_spec[:2], None, None), P(*kv_spec[:2], None, None)
    return ttt_attention_context_parallel(q, k0, v0, kd, vd, segment_ids_bt, mesh=mesh,
                                          axis=meshlib.CONTEXT_AXIS, q_spec=q_spec, kv_spec=kv_spec)


def draft_step(
    params: dict,
    cfg: Eagle3Config,
    emb_btd: jnp.ndarray,
    hidden_btd: jnp.ndarray,
    positions_bt: jnp.ndarray,
    segment_ids_bt: Optional[jnp.ndarray],
    kv_caches: list,
    *,
    attention_impl: Optional[str] = None,
):
    """One TTT step through every draft layer. `kv_caches[l]` holds layer l's (k, v) of the earlier
    steps ([] at step 0). Returns (h_out pre-norm [B,T,H], [(k_new, v_new) per layer])."""
    h, new = hidden_btd, []
    for layer in range(cfg.num_layers):
        h, kv = decoder_layer(params, cfg, emb_btd, h, positions_bt, segment_ids_bt, kv_caches[layer],
                              attention_impl=attention_impl, layer=layer)
        new.append(kv)
    return h, new


def decoder_layer(
    params: dict,
    cfg: Eagle3Config,
    emb_btd: jnp.ndarray,
    hidden_btd: jnp.ndarray,
    positions_bt: jnp.ndarray,
    segment_ids_bt: Optional[jnp.ndarray],
    kv_cache: list,
    *,
    attention_impl: Optional[str] = None,
    layer: int = 0,
):
    """One draft layer of one step. `kv_cache` holds this layer's (k, v) of earlier TTT steps ([] at
    step 0); step k = len(kv_cache). `emb_btd` is read by layer 0 only.

    Returns (h_out pre-norm [B,T,H], (k_new, v_new)). RoPE positions are `positions + k` for the
    queries and the new keys, so the diagonal key of step i sits at t+i
    (docs/eagle3-format.md, "TTT training semantics").
    """
    B, T, _ = hidden_btd.shape
    step = len(kv_cache)
    q, k, v = attention_qkv(params, cfg, emb_btd, hidden_btd, positions_bt + step, layer=layer)
    if step == 0:
        k0, v0, kd, vd = k, v, None, None
    else:
        k0, v0 = kv_cache[0]
        kd = jnp.stack([kv[0] for kv in kv_cache[1:]] + [k])
        vd = jnp.stack([kv[1] for kv in kv_cache[1:]] + [v])
    cp_mesh = meshlib.context_mesh()
    if cp_mesh is not None:  # sequence split over `context`: explicit K/V all-gather (shard_map)
        attn = _ttt_attention_cp(q, k0, v0, kd, vd, segment_ids_bt, cp_mesh)
    else:
        attn = ttt_attention(q, k0, v0, kd, vd, segment_ids_bt, implementation=attention_impl)
    return layer_output(params, cfg, hidden_btd, attn, layer=layer), (k, v)


def layer_params(params: dict, layer: int) -> dict:
    """The params of draft decoder layer `layer` (0: `midlayer`, then `layers.{i}`)."""
    return params["midlayer"] if layer == 0 else params["layers"][str(layer)]


def attention_qkv(params: dict, cfg: Eagle3Config, emb_btd, hidden_btd, rope_positions_bt, layer: int = 0):
    """q [B,T,nH,hd], k/v [B,T,nKV,hd] of draft layer `layer`, with RoPE at `rope_positions` (shared
    by training and the cached decoder in specjax.eval.spec_decode): layer 0 projects
    [input_layernorm(emb), hidden_norm(h)], a later layer input_layernorm(h)."""
    m = layer_params(params, layer)
    eps = cfg.rms_norm_eps
    B, T, _ = hidden_btd.shape
    if layer == 0:
        x = jnp.concatenate([rms_norm(emb_btd, m["input_layernorm"]["scale"], eps),
                             rms_norm(hidden_btd, m["hidden_norm"]["scale"], eps)], axis=-1)
    else:
        x = rms_norm(hidden_btd, m["input_layernorm"]["scale"], eps)
    a = m["self_attn"]
    nH, nKV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = _mm(x, a["q_proj"]).reshape(B, T, nH, hd)
    k = _mm(x, a["k_proj"]).reshape(B, T, nKV, hd)
    v = _mm(x, a["v_proj"]).reshape(B, T, nKV, hd)
    # the target's tables (LongRoPE's per-call set, YaRN's cos/sin factor), as the engines' draft builds them
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, rope_positions_bt, q.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_output(params: dict, cfg: Eagle3Config, hidden_btd, attn_btnh, layer: int = 0):
    """The rest of draft layer `layer` after attention: residual (the layer's pre-norm input) +
    o_proj, then the SwiGLU MLP block. Returns the pre-norm h_out [B,T,H]."""
    m = layer_params(params, layer)
    B, T, _ = hidden_btd.shape
    h = hidden_btd + _mm(attn_btnh.reshape(B, T, -1), m["self_attn"]["o_proj"])
    mlp = m["mlp"]
    xn = rms_norm(h, m["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
    return h + _mm(jax.nn.silu(_mm(xn, mlp["gate_proj"])) * _mm(xn, mlp["up_proj"]), mlp["down_proj"])


def draft_logits(params: dict, cfg: Eagle3Config, h_btd: jnp.ndarray) -> jnp.ndarray:
    """lm_head(norm(h)) over the draft vocab, in fp32 (fp64 for fp64 input)."""
    hn = rms_norm(h_btd, params["norm"]["scale"], cfg.rms_norm_eps)
    return jnp.einsum("btd,dv->btv", hn, params["lm_head"]["kernel"].astype(hn.dtype),
                      preferred_element_type=accum_dtype(hn))


def next_step_hidden(params: dict, cfg: Eagle3Config, h_btd: jnp.ndarray) -> jnp.ndarray:
    """The hidden state the next draft step reads: the pre-norm output (EAGLE-3), or its final-norm
    output when cfg.norm_output (the vLLM/SGLang meaning of `norm_output`;
    docs/eagle3-format.md, "EAGLE-3.1 flags (fc_norm, norm_output)")."""
    if not cfg.norm_output:
        return h_btd
    return rms_norm(h_btd, params["norm"]["scale"].astype(h_btd.dtype), cfg.rms_norm_eps)


def config_from_target(target_cfg, *, draft_vocab_size: int, aux_layer_ids, intermediate_size=None,
                       num_attention_heads=None, num_key_value_heads=None, head_dim=None,
                       fc_norm: bool = False, norm_output: bool = False, num_layers: int = 1,
                       parallel_drafting: bool = False, mask_token_id: Optional[int] = None,
                       train_embedding: bool = False) -> Eagle3Config:
    """Draft shape from the target's config; the hidden size must be the target's embedding width."""
    H = target_cfg.hidden_size
    nH = num_attention_heads or target_cfg.num_attention_heads
    cfg = Eagle3Config(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=nH,
        num_key_value_heads=num_key_value_heads or target_cfg.num_key_value_heads,
        head_dim=head_dim or (target_cfg.head_dim if num_attention_heads is None else H // nH),
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope=target_cfg.rope,
        max_position_embeddings=target_cfg.max_position_embeddings,
        fc_norm=bool(fc_norm),
        norm_output=bool(norm_output),
        num_layers=int(num_layers),
        parallel_drafting=bool(parallel_drafting),
        mask_token_id=None if mask_token_id is None else int(mask_token_id),
        train_embedding=bool(train_embedding),
    )
    cfg.validate()
    return cfg


def config_to_dict(cfg: Eagle3Config) -> dict:
    d = dataclasses.asdict(cfg)
    d["aux_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def config_from_dict(d: dict) -> Eagle3Config:
    d = dict(d)
    d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
    d["rope"] = RopeSpec(**d["rope"])
    return Eagle3Config(**d)


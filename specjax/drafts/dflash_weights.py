"""The DFlash block drafter's weights as one table (plain Python, no jax: the converters read it).

One `specjax.drafts.weights.DraftWeight` row per weight; `{i}` is the draft layer index 0..N-1.
The file names are the ones vLLM's DFlash loader (`DFlashDraftModel` -> qwen3_dflash) and a
speculators DFlash checkpoint both use: `fc`, `hidden_norm`, `layers.{i}.*` (Qwen3 decoder layers
with per-head `q_norm` / `k_norm`), `norm`, `lm_head` (draft vocab rows, HF [Vd, H]). No
`embed_tokens`: the draft reads the target's embedding (the mask token's row included), and the
engines share the target's table when the file has none. Kernels are stored transposed (HF
[out, in]); norm scales as they are.

specjax.drafts.dflash re-exports DFLASH_WEIGHTS and derives init and logical axes from it;
specjax_converters.dflash_export derives the file names and shapes from it.
"""
from __future__ import annotations

from specjax.drafts.weights import INTER, KV, Q, VD, Dim, DraftWeight, H

FC_IN = Dim("aux*H", lambda c: len(c.aux_layer_ids) * c.hidden_size)  # fc input: the taps concatenated
HEAD_DIM = Dim("hd", lambda c: c.head_dim)
NUM_LAYERS = Dim("N", lambda c: c.num_layers)

DFLASH_WEIGHTS: tuple[DraftWeight, ...] = (
    #           specjax param          file name             shape         logical axes              init      transpose
    DraftWeight("fc.kernel",           "fc.weight",          (FC_IN, H),   (None, "embed"),          "normal", True),
    DraftWeight("hidden_norm.scale",   "hidden_norm.weight", (H,),         ("norm",),                "ones",   False),
) + tuple(
    DraftWeight(f"layers.{{i}}.{name}", f"layers.{{i}}.{fname}", shape, axes, init, transpose, repeat=NUM_LAYERS)
    for name, fname, shape, axes, init, transpose in (
        ("input_layernorm.scale",          "input_layernorm.weight",          (H,),         ("norm",),             "ones",   False),
        ("self_attn.q_proj.kernel",        "self_attn.q_proj.weight",         (H, Q),       ("embed", "heads"),    "normal", True),
        ("self_attn.k_proj.kernel",        "self_attn.k_proj.weight",         (H, KV),      ("embed", "kv_heads"), "normal", True),
        ("self_attn.v_proj.kernel",        "self_attn.v_proj.weight",         (H, KV),      ("embed", "kv_heads"), "normal", True),
        ("self_attn.o_proj.kernel",        "self_attn.o_proj.weight",         (Q, H),       ("heads", "embed"),    "normal", True),
        ("self_attn.q_norm.scale",         "self_attn.q_norm.weight",         (HEAD_DIM,),  ("norm",),             "ones",   False),
        ("self_attn.k_norm.scale",         "self_attn.k_norm.weight",         (HEAD_DIM,),  ("norm",),             "ones",   False),
        ("post_attention_layernorm.scale", "post_attention_layernorm.weight", (H,),         ("norm",),             "ones",   False),
        ("mlp.gate_proj.kernel",           "mlp.gate_proj.weight",            (H, INTER),   ("embed", "mlp"),      "normal", True),
        ("mlp.up_proj.kernel",             "mlp.up_proj.weight",              (H, INTER),   ("embed", "mlp"),      "normal", True),
        ("mlp.down_proj.kernel",           "mlp.down_proj.weight",            (INTER, H),   ("mlp", "embed"),      "normal", True),
    )
) + (
    DraftWeight("norm.scale",          "norm.weight",        (H,),         ("norm",),                "ones",   False),
    DraftWeight("lm_head.kernel",      "lm_head.weight",     (H, VD),      ("embed", "draft_vocab"), "normal", True),
)

# Not weights: the vocab maps written beside them when the draft vocab is smaller than the target's
# (specjax.drafts.vocab.DraftVocab). vLLM loads d2t as draft_id_to_target_id and skips t2d;
# speculators holds both as buffers. Written only when Vd < V: vLLM has no d2t parameter for a
# full-vocab draft and refuses a tensor it cannot place.
DFLASH_VOCAB_TENSORS = {"d2t": "int64", "t2d": "bool"}

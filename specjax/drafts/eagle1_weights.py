"""The EAGLE-1 draft's weights as one table (plain Python, no jax: the converters read it).

One `specjax.drafts.weights.DraftWeight` row per weight. The head is vLLM's `EagleLlamaForCausalLM`
(vllm/model_executor/models/llama_eagle.py): `fc` [H, 2H] (no bias) over concat(embed(token),
feature), then one Llama decoder layer whose input_layernorm vLLM replaces by the identity (so the
file has none), stored as `layers.0.*`. No `norm`, no `lm_head`, no `embed_tokens`: the engine feeds
the layer's output straight to the target's lm_head and embeds with the target's table (it shares
both when the file has neither). The param tree names the layer `midlayer` (EAGLE-3's name for its
single layer), so specjax.drafts.eagle3.layer_output runs it unchanged.
"""
from __future__ import annotations

from specjax.drafts.weights import INTER, KV, Q, Dim, DraftWeight, H

FC_IN = Dim("2H", lambda c: 2 * c.hidden_size)  # fc input: [embed(token), feature]

EAGLE1_WEIGHTS: tuple[DraftWeight, ...] = (
    #           specjax param                              file name                                  shape        logical axes           init      transpose
    DraftWeight("fc.kernel",                               "fc.weight",                               (FC_IN, H),  (None, "embed"),       "normal", True),
    DraftWeight("midlayer.self_attn.q_proj.kernel",        "layers.0.self_attn.q_proj.weight",        (H, Q),      ("embed", "heads"),    "normal", True),
    DraftWeight("midlayer.self_attn.k_proj.kernel",        "layers.0.self_attn.k_proj.weight",        (H, KV),     ("embed", "kv_heads"), "normal", True),
    DraftWeight("midlayer.self_attn.v_proj.kernel",        "layers.0.self_attn.v_proj.weight",        (H, KV),     ("embed", "kv_heads"), "normal", True),
    DraftWeight("midlayer.self_attn.o_proj.kernel",        "layers.0.self_attn.o_proj.weight",        (Q, H),      ("heads", "embed"),    "normal", True),
    DraftWeight("midlayer.post_attention_layernorm.scale", "layers.0.post_attention_layernorm.weight", (H,),       ("norm",),             "ones",   False),
    DraftWeight("midlayer.mlp.gate_proj.kernel",           "layers.0.mlp.gate_proj.weight",           (H, INTER),  ("embed", "mlp"),      "normal", True),
    DraftWeight("midlayer.mlp.up_proj.kernel",             "layers.0.mlp.up_proj.weight",             (H, INTER),  ("embed", "mlp"),      "normal", True),
    DraftWeight("midlayer.mlp.down_proj.kernel",           "layers.0.mlp.down_proj.weight",           (INTER, H),  ("mlp", "embed"),      "normal", True),
)

# vLLM's architecture for the head (its registry maps it to llama_eagle.EagleLlamaForCausalLM; with
# method "eagle" vLLM keeps a name that starts with "Eagle" as it is)
ARCHITECTURE = "EagleLlamaForCausalLM"

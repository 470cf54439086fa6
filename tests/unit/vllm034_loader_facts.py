"""What vLLM 0.34.0 reads from a DFlash 2, a DSpark and an XPress head folder: the config.json keys, the
renaming its `load_weights` applies to the file's tensor names, and the parameters (names and shapes)
the renamed tensors must land in. Read by tests/unit/test_vllm034_loaders.py.

Written in our words from the 0.34.0 wheel (`pip download vllm==0.34.0 --no-deps`, unzipped); no vLLM
code is copied. Every fact names FILE:LINE under that wheel's `vllm/` folder. The wheel is a CUDA
build; nothing here imports it.

Serving, from the same files (not run here):
  * DFlash 2 heads load as `DFlash2DraftModel` (model_executor/models/registry.py:688) through the
    speculators reader (transformers_utils/configs/speculators/algos.py:97-117) and run with method
    "dflash" (transformers_utils/configs/speculators/base.py:135-136), drafted by
    v1/worker/gpu/spec_decode/dflash2/speculator.py.
  * DSpark heads load as `Qwen3DSparkModel` (registry.py:711), method "dspark"
    (v1/worker/gpu/spec_decode/dspark/config.py:21).
  * XPress: 0.34 has a model (`Qwen3XPressModel`, registry.py:716-717) but reads it from a plain
    Qwen3 config.json with `xpress_*` keys and `xpress_head.*` tensors; its speculators reader has no
    "xpress" type (algos.py:15-177 registers eagle3, peagle, dflash, dflash2, dspark), so a
    speculators-layout XPress folder (what specjax writes by default) is refused (base.py:51-56).
    Qwen3XPressForCausalLM declares XPressSpeculatorConfig (models/qwen3_xpress.py:290), whose base
    method is "dflash" (xpress/config.py:7, dflash/config.py:15): served with method "dflash"
    (speculator_config.py:378-389 picks the declared subclass, :413-426 refuses another method).
  * CPU: 0.34's x86 CPU platform needs Triton's CPU backend (platforms/cpu.py:241-243) and runs the
    same V2 model runner as the GPU (v1/worker/cpu/model_runner.py:10); no code on the DFlash, DFlash 2,
    DSpark or XPress paths refuses a CPU, and the CPU attention backend accepts non-causal layers
    (v1/attention/backends/cpu_attn.py:90-91). The grouped convolution and candidate scoring of
    DFlash 2 have torch fallbacks for non-CUDA tensors (models/qwen3_dflash2.py:154-168, 415-432); the
    runners' own kernels (dflash/speculator.py, dspark/speculator.py, xpress/kernels.py) are Triton.
"""
from __future__ import annotations

# speculators_model_type values 0.34's speculators reader registers (algos.py:15, 53, 58, 97, 120);
# "peagle" is registered only to refuse it (algos.py:53-55)
SPECULATORS_TYPES = ("eagle3", "peagle", "dflash", "dflash2", "dspark")

# P-EAGLE: 0.34 accepts `parallel_drafting` only with these methods and refuses it with any other
# (config/speculative.py:1688-1692), so the {"method": "eagle3", "parallel_drafting": true} a P-EAGLE
# head is served with on vLLM 0.32 is refused; its speculators form ("peagle") is refused too (algos.py:53-55)
PARALLEL_DRAFTING_METHODS = ("dflash", "dspark")
PARALLEL_DRAFTING_SOURCE = "config/speculative.py:1688-1692"

# ---------------------------------------------------------------------------------------------
# config.json keys: (dotted path, JSON type, required, source). Types: int, bool, number, str, dict,
# int_list, str_list, any (the key must exist, any value). "absent" keys would change what is built.
# ---------------------------------------------------------------------------------------------
LAYER_KEYS = (  # the Qwen3 decoder fields the DFlash backbone reads (models/qwen3_dflash.py)
    ("hidden_size", "int", True, "models/qwen3_dflash.py:343,392-395"),
    ("num_hidden_layers", "int", True, "models/qwen3_dflash.py:515"),
    ("num_attention_heads", "int", True, "models/qwen3_dflash.py:368"),
    ("num_key_value_heads", "int", True, "models/qwen3_dflash.py:370"),
    ("head_dim", "int", False, "models/qwen3_dflash.py:378 (else hidden_size / heads: :231)"),
    ("intermediate_size", "int", True, "models/qwen3_dflash.py:387"),
    ("hidden_act", "str", True, "models/qwen3_dflash.py:388"),
    ("rms_norm_eps", "number", True, "models/qwen3_dflash.py:371"),
    ("max_position_embeddings", "int", True, "models/qwen3_dflash.py:369"),
    ("rope_parameters", "dict", True, "models/qwen3_dflash.py:381"),
    ("vocab_size", "int", True, "models/qwen3_dflash.py:485-488 (embed_tokens rows)"),
    ("attention_bias", "bool", False, "models/qwen3_dflash.py:372 (default false)"),
    ("layer_types", "str_list", False, "models/qwen3_dflash.py:94-97,162-174 (sliding layers are causal)"),
)

DFLASH2_KEYS = (
    ("speculators_model_type", "str", True, "speculators/base.py:51-56, algos.py:97"),
    ("speculators_config.proposal_methods.0.speculative_tokens", "int", True, "speculators/base.py:120-126"),
    ("speculators_config.verifier.name_or_path", "any", True, "speculators/base.py:83 (a hub id when the head is "
     "passed as --model: transformers_utils/config.py:905-919)"),
    ("transformer_layer_config", "dict", True, "speculators/base.py:59,88-94"),
    *(("transformer_layer_config." + k, t, r, s) for k, t, r, s in LAYER_KEYS),
    ("aux_hidden_state_layer_ids", "int_list", True, "algos.py:82-83"),
    ("mask_token_id", "int", True, "algos.py:86-87"),
    ("draft_vocab_size", "int", False, "algos.py:78 (else vocab_size: models/qwen3_dflash.py:874-875)"),
    ("target_hidden_size", "int", False, "algos.py:79-80 (else hidden_size: models/qwen3_dflash.py:131-133)"),
    ("sample_from_anchor", "bool", False, "algos.py:89 (default false)"),
    ("sliding_window_non_causal", "bool", False, "algos.py:92-94 (default true)"),
    ("conv_kernel_size", "int", True, "algos.py:110-117, models/qwen3_dflash2.py:254"),
    ("conv_group_size", "int", True, "algos.py:110-117, models/qwen3_dflash2.py:255"),
    ("selector_rank", "int", True, "algos.py:110-117, models/qwen3_dflash2.py:534"),
    ("selector_top_k", "int", True, "algos.py:110-117, models/qwen3_dflash2.py:535, dflash2/speculator.py:202-203"),
)
# a NoPE layer list turns the head into another architecture (config/speculative.py:796-800)
DFLASH2_ABSENT = (("transformer_layer_config.no_rope_layers", "config/speculative.py:796-800"),)

DSPARK_KEYS = (
    ("architectures", "str_list", True, "registry.py:711 (Qwen3DSparkModel; not rewritten for it: "
     "config/speculative.py:789-795)"),
    ("model_type", "str", True, "a transformers Qwen3 config (transformers_utils/config.py:366)"),
    *LAYER_KEYS,
    ("draft_vocab_size", "int", False, "models/qwen3_dspark.py:207-209,245-246 (else vocab_size)"),
    ("target_hidden_size", "int", False, "models/qwen3_dflash.py:131-133 (else hidden_size)"),
    ("markov_rank", "int", True, "models/qwen3_dspark.py:213"),
    ("enable_confidence_head", "bool", False, "models/qwen3_dspark.py:221 (default false)"),
    ("confidence_head_with_markov", "bool", False, "models/qwen3_dspark.py:222 (default false)"),
    ("mask_token_id", "int", True, "v1/worker/gpu/spec_decode/utils.py:151-152, models/qwen3_dflash.py:496-498"),
    ("target_layer_ids", "int_list", True, "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:127-130 (+1 each)"),
    ("use_aux_hidden_state", "bool", False, "models/qwen3_dflash.py:478-481 (default true: fc is built)"),
    ("block_size", "int", True, "dspark/config.py:78-85 (num_speculative_tokens when none is given)"),
    ("sample_from_anchor", "bool", False, "dspark/speculator.py:62-68, dspark/config.py:130-137 (default TRUE)"),
)
# keys that eagle3_utils.py:109-126 reads before target_layer_ids, so they must not be there
DSPARK_ABSENT = (("eagle_aux_hidden_state_layer_ids", "eagle3_utils.py:109"),
                 ("dflash_config", "eagle3_utils.py:110-114, models/qwen3_dflash.py:475-476"),
                 ("dspark_target_layer_ids", "eagle3_utils.py:115-125"))
# Qwen3DSparkModel builds only the first-order Markov head (markov_w1, markov_w2: models/qwen3_dspark.py:
# 49-82, 210-219); markov_head_type is read only for Qwen3-Omni (config/speculative.py:357), so a gated
# or rnn head's extra tensors have no parameter and the load fails (models/utils.py:450-459)
DSPARK_MARKOV_HEAD_TYPES = ("vanilla",)

XPRESS_KEYS = (  # 0.34's own XPress layout: a Qwen3 config with these keys
    ("architectures", "str_list", True, "registry.py:716-717 (Qwen3XPressModel)"),
    ("model_type", "str", True, "transformers_utils/config.py:366"),
    *LAYER_KEYS,
    ("draft_vocab_size", "int", False, "models/qwen3_xpress.py:297-298,317-322 (must equal the target vocab)"),
    ("xpress_block_size", "int", False, "models/qwen3_xpress.py:273-274 (else num_speculative_steps + 1, 16)"),
    ("xpress_rank", "int", False, "models/qwen3_xpress.py:275 (default 256)"),
    ("xpress_mlp_hidden", "int", False, "models/qwen3_xpress.py:276 (default 512)"),
    ("xpress_topc", "int", False, "models/qwen3_xpress.py:278, xpress/config.py:13-29 (default 512: scores only "
     "the top 512 base candidates per pass, :40-46; 0 scores the whole vocab)"),
    ("xpress_num_passes", "int", False, "xpress/speculator.py:38 (default 6)"),
    ("sample_from_anchor", "bool", False, "xpress/speculator.py:29-34 (true is refused)"),
    ("mask_token_id", "int", True, "v1/worker/gpu/spec_decode/utils.py:148-152 (dflash_config's first)"),
    ("target_layer_ids", "int_list", True, "eagle3_utils.py:127-130 (+1 each; read through the EAGLEConfig that "
     "method dflash wraps the config in: dflash/config.py:28-30, transformers_utils/configs/eagle.py:65-88)"),
)
# read before the top-level taps / mask token, so they must not be there (as for DSpark)
XPRESS_ABSENT = (("eagle_aux_hidden_state_layer_ids", "eagle3_utils.py:109"),
                 ("dflash_config", "eagle3_utils.py:110-114, v1/worker/gpu/spec_decode/utils.py:148-149, "
                  "models/qwen3_dflash.py:475-476"),
                 ("dspark_target_layer_ids", "eagle3_utils.py:115-125"))

# ---------------------------------------------------------------------------------------------
# renaming of the file's tensor names by load_weights, as ordered steps:
#   ("refuse", s)   a name containing s stops the load
#   ("skip", s)     a name containing s is dropped
#   ("sub", a, b)   a -> b (first match only)
#   ("prefix", p, unless)   p + name, unless the name contains one of `unless`
#   ("stack", a, b, shard)  inside the model: a -> b, the tensor being shard `shard` of b
# "skip_unless_param" in PARAMS below: a tensor dropped when the model has no such parameter.
# ---------------------------------------------------------------------------------------------
BACKBONE_STACKS = (  # DFlashQwen3Model.hf_to_vllm_mapper (models/qwen3_dflash.py:423-442)
    ("sub", "midlayer", "layers.0"),  # :427
    ("stack", ".q_proj", ".qkv_proj", "q"), ("stack", ".k_proj", ".qkv_proj", "k"),  # :437-438
    ("stack", ".v_proj", ".qkv_proj", "v"),  # :439
    ("stack", ".gate_proj", ".gate_up_proj", 0), ("stack", ".up_proj", ".gate_up_proj", 1),  # :440-441
)
DFLASH2_RENAMES = (  # DFlashQwen3ForCausalLM.load_weights (models/qwen3_dflash.py:981-1021), inherited
    ("refuse", "mask_hidden"),  # :986-990
    ("skip", "t2d"),  # :991-992
    ("sub", "d2t", "draft_id_to_target_id"),  # :993-995
    ("prefix", "model.", ("lm_head", "draft_id_to_target_id")),  # :993-997 (else-branch of the d2t rename)
    ("skip", "mask_embedding"),  # :1017-1018 (the mask row comes from mask_embedding.pt, if any)
) + BACKBONE_STACKS
DSPARK_RENAMES = (  # Qwen3DSparkForCausalLM.load_weights (models/qwen3_dspark.py:321-359)
    ("skip", "t2d"),  # :328-329
    ("sub", "d2t", "draft_id_to_target_id"),  # :330-332
    ("prefix", "model.", ("lm_head", "draft_id_to_target_id")),  # :330-334
    ("skip", "mask_embedding"),  # :348
) + BACKBONE_STACKS
XPRESS_RENAMES = (  # Qwen3XPressForCausalLM.load_weights (models/qwen3_xpress.py:331-374)
    ("skip", "t2d"), ("skip", "d2t"),  # :337-338
    # xpress_head.<sub>: mlp.*_proj -> mlp_*; others kept (:339-345, map :242-252); mix.L is the
    # raw mixer, held aside and folded to L*tril + I after loading (:341-343, 372-374, 86-95)
    ("sub", "xpress_head.mlp.gate_proj.", "xpress_head.mlp_gate."),
    ("sub", "xpress_head.mlp.up_proj.", "xpress_head.mlp_up."),
    ("sub", "xpress_head.mlp.down_proj.", "xpress_head.mlp_down."),
    ("prefix", "model.", ("lm_head",)),  # :339-347
    ("skip", "mask_embedding"), ("skip", "xpress_head.mix_L"),  # :358, 363-367
) + BACKBONE_STACKS

# ---------------------------------------------------------------------------------------------
# parameters: name ({i} = draft layer) -> (shape, or {shard: shape} for a stacked one; need; source).
# Shapes are functions of `view` (test_vllm034_loaders.view_of: what 0.34 derives from config.json).
# need: "required" (left unset if the file lacks it: no error, since these load_weights return
# nothing for the loader to check, model_loader/default_loader.py:540-550), "optional" (shared from
# the target when absent), "if_d2t" (exists only for a smaller draft vocab), "own_if_d2t" (optional
# for a full draft vocab, required for a smaller one), "if_confidence" (exists only with the head).
# Every nn.Linear-like weight is [out, in]; embeddings and LM heads [rows, width] (rows may be padded
# to 64 in memory; the file's rows are checked: vocab_parallel_embedding.py:514-524).
# ---------------------------------------------------------------------------------------------
BACKBONE_PARAMS = {
    "model.fc.weight": (lambda v: (v["H"], v["tH"] * len(v["aux"])), "required",
                        "models/qwen3_dflash.py:125-134,518-528"),
    "model.hidden_norm.weight": (lambda v: (v["H"],), "required", "models/qwen3_dflash.py:530-533"),
    "model.norm.weight": (lambda v: (v["H"],), "required", "models/qwen3_dflash.py:534-537"),
    "model.layers.{i}.input_layernorm.weight": (lambda v: (v["H"],), "required", "models/qwen3_dflash.py:392"),
    "model.layers.{i}.post_attention_layernorm.weight": (lambda v: (v["H"],), "required",
                                                         "models/qwen3_dflash.py:393-395"),
    "model.layers.{i}.self_attn.qkv_proj.weight": (
        lambda v: {"q": (v["nh"] * v["hd"], v["H"]), "k": (v["nkv"] * v["hd"], v["H"]),
                   "v": (v["nkv"] * v["hd"], v["H"])}, "required", "models/qwen3_dflash.py:237-245"),
    "model.layers.{i}.self_attn.o_proj.weight": (lambda v: (v["H"], v["nh"] * v["hd"]), "required",
                                                 "models/qwen3_dflash.py:246-252"),
    "model.layers.{i}.self_attn.q_norm.weight": (lambda v: (v["hd"],), "required", "models/qwen3_dflash.py:298"),
    "model.layers.{i}.self_attn.k_norm.weight": (lambda v: (v["hd"],), "required", "models/qwen3_dflash.py:299"),
    "model.layers.{i}.mlp.gate_up_proj.weight": (lambda v: {0: (v["I"], v["H"]), 1: (v["I"], v["H"])}, "required",
                                                 "models/qwen3_dflash.py:385-391, models/qwen2.py:91-94"),
    "model.layers.{i}.mlp.down_proj.weight": (lambda v: (v["H"], v["I"]), "required", "models/qwen2.py:98-100"),
    "model.embed_tokens.weight": (lambda v: (v["V"], v["H"]), "optional",
                                  "models/qwen3_dflash.py:485-489; shared from the target when absent "
                                  "(dflash/utils.py:60, dspark/utils.py:133-134)"),
    "lm_head.weight": (lambda v: (v["Vd"], v["H"]), "own_if_d2t",
                       "models/qwen3_dflash.py:884-893; the target's when absent, which fits only a full "
                       "draft vocab (dflash/utils.py:62-73, dspark/utils.py:136-145)"),
    "draft_id_to_target_id": (lambda v: (v["Vd"],), "if_d2t",
                              "models/qwen3_dflash.py:897-904 (int64 offsets: target id = draft id + d2t)"),
}

DFLASH2_PARAMS = {
    **BACKBONE_PARAMS,
    # the two grouped convolutions around each sublayer (models/qwen3_dflash2.py:171-227, 261-266):
    # base taps [side, tap, channel]; the projection's rows read as (side, tap, group) (:219-222)
    **{f"model.layers.{{i}}.{conv}.base_kernel": (lambda v: (2, v["taps"], v["H"]), "required",
                                                  "models/qwen3_dflash2.py:191-194")
       for conv in ("attention_conv", "mlp_conv")},
    **{f"model.layers.{{i}}.{conv}.kernel_projection.weight": (
        lambda v: (2 * v["taps"] * (v["H"] // v["group"]), v["H"]), "required", "models/qwen3_dflash2.py:195-203")
       for conv in ("attention_conv", "mlp_conv")},
    # the candidate selector (models/qwen3_dflash2.py:463-507, built at :531-538 over vocab_size)
    "model.candidate_selector.predecessor_codebook": (lambda v: (v["V"], v["rank"]), "required",
                                                      "models/qwen3_dflash2.py:475-477"),
    "model.candidate_selector.successor_codebook": (lambda v: (v["V"], v["rank"]), "required",
                                                    "models/qwen3_dflash2.py:478-480"),
    "model.candidate_selector.hidden_projection.weight": (lambda v: (v["rank"], v["H"]), "required",
                                                          "models/qwen3_dflash2.py:481-489"),
}

DSPARK_PARAMS = {
    **BACKBONE_PARAMS,
    "draft_id_to_target_id": (lambda v: (v["Vd"],), "if_d2t",
                              "models/qwen3_dspark.py:267-273 (only when draft_vocab_size < the target's)"),
    "model.markov_head.markov_w1.weight": (lambda v: (v["V"], v["markov_rank"]), "required",
                                           "models/qwen3_dspark.py:72 (an embedding over vocab_size)"),
    "model.markov_head.markov_w2.weight": (lambda v: (v["Vd"], v["markov_rank"]), "required",
                                           "models/qwen3_dspark.py:73-80 (rows: draft_vocab_size)"),
    # built only with enable_confidence_head (models/qwen3_dspark.py:220-231); fp32, with a bias (:177-184);
    # a file's confidence tensors are dropped when it is off (:355-356)
    "model.confidence_head.proj.weight": (lambda v: (1, v["H"] + (v["markov_rank"] if v["conf_markov"] else 0)),
                                          "if_confidence", "models/qwen3_dspark.py:223-231"),
    "model.confidence_head.proj.bias": (lambda v: (1,), "if_confidence", "models/qwen3_dspark.py:229"),
}

XPRESS_PARAMS = {  # the refiner head (models/qwen3_xpress.py:23-59), r = xpress_rank, m = xpress_mlp_hidden
    **BACKBONE_PARAMS,
    "model.xpress_head.w1.weight": (lambda v: (v["V"], v["r"]), "required", "models/qwen3_xpress.py:48"),
    "model.xpress_head.down_h.weight": (lambda v: (v["r"], v["H"]), "required", "models/qwen3_xpress.py:49"),
    "model.xpress_head.down_g.weight": (lambda v: (v["r"], v["H"]), "required", "models/qwen3_xpress.py:50"),
    "model.xpress_head.in_proj.weight": (lambda v: (v["r"], 3 * v["r"]), "required", "models/qwen3_xpress.py:51"),
    "model.xpress_head.mix.L": (lambda v: (v["r"], v["B"], v["B"]), "required",
                                "models/qwen3_xpress.py:55,86-95,341-343 (raw; folded after loading)"),
    "model.xpress_head.mlp_gate.weight": (lambda v: (v["m"], v["r"]), "required", "models/qwen3_xpress.py:56"),
    "model.xpress_head.mlp_up.weight": (lambda v: (v["m"], v["r"]), "required", "models/qwen3_xpress.py:57"),
    "model.xpress_head.mlp_down.weight": (lambda v: (v["r"], v["m"]), "required", "models/qwen3_xpress.py:58"),
    "model.xpress_head.w2.weight": (lambda v: (v["V"], v["r"]), "required", "models/qwen3_xpress.py:59"),
}
del XPRESS_PARAMS["draft_id_to_target_id"]  # never built: a full vocab is required (qwen3_xpress.py:317-323)

# What a specjax (speculators-layout) XPress export would need to become 0.34's layout. OURS, not
# vLLM's: the tensor renames (left: xpress_weights.py's file names; right: 0.34's, per the rows above)
# and the config keys (right: XPRESS_KEYS). Differences in behaviour a rename does not fix:
#   * slot 0's previous token: specjax and speculators read the token before the anchor
#     (specjax/drafts/xpress.py:14-15); 0.34 reads the anchor itself (xpress/speculator.py:87-90);
#   * 0.34 scores each Jacobi pass on the top xpress_topc (512) base candidates unless xpress_topc is 0
#     (models/qwen3_xpress.py:40-46, 148-189); specjax scores the whole draft vocab;
#   * 0.34 needs draft_vocab_size == the target vocab (models/qwen3_xpress.py:317-322); specjax allows less.
XPRESS_FROM_SPECJAX = {
    "refiner_head.token_embed.weight": "xpress_head.w1.weight",
    "refiner_head.down_h.weight": "xpress_head.down_h.weight",
    "refiner_head.down_g.weight": "xpress_head.down_g.weight",
    "refiner_head.in_proj.weight": "xpress_head.in_proj.weight",
    "refiner_head.mix_l": "xpress_head.mix.L",  # both raw [r, S, S], lower triangle + identity residual
    "refiner_head.mlp_gate.weight": "xpress_head.mlp.gate_proj.weight",
    "refiner_head.mlp_up.weight": "xpress_head.mlp.up_proj.weight",
    "refiner_head.mlp_down.weight": "xpress_head.mlp.down_proj.weight",
    "refiner_head.readout.weight": "xpress_head.w2.weight",
}


# ---------------------------------------------------------------------------------------------
# what 0.34 derives from config.json (the attributes the rows above are sized by); `target_vocab` is
# the target model's vocab_size
# ---------------------------------------------------------------------------------------------
def _layer_view(layer: dict) -> dict:
    H, nh = layer["hidden_size"], layer["num_attention_heads"]
    return {"H": H, "L": layer["num_hidden_layers"], "nh": nh, "nkv": layer["num_key_value_heads"],
            "hd": layer.get("head_dim") or H // nh,  # models/qwen3_dflash.py:231
            "I": layer["intermediate_size"], "V": layer["vocab_size"]}


def _causal(layer: dict, dflash_config: dict) -> bool:
    """Whether any draft layer attends causally: is_causal, else dflash_config.causal, else the sliding
    layers of layer_types (models/qwen3_dflash.py:86-97)."""
    if layer.get("is_causal") is not None:
        return bool(layer["is_causal"])
    if dflash_config.get("causal") is not None:
        return bool(dflash_config["causal"])
    return any(t == "sliding_attention" for t in layer.get("layer_types") or [])


def dflash2_view(conf: dict, target_vocab: int) -> dict:
    v = _layer_view(conf["transformer_layer_config"])  # speculators/base.py:59
    aux = conf["aux_hidden_state_layer_ids"]
    n = conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    v.update(
        method="dflash",  # speculators/base.py:135-136
        Vd=conf.get("draft_vocab_size") or v["V"],  # algos.py:78, models/qwen3_dflash.py:874-875
        tH=conf.get("target_hidden_size") or v["H"],  # models/qwen3_dflash.py:131-133
        aux=aux, target_layer_ids=[i - 1 for i in aux],  # algos.py:86-88
        mask_token_id=conf["mask_token_id"],  # algos.py:87
        sample_from_anchor=conf.get("sample_from_anchor", False),  # algos.py:89
        # algos.py:92-94 always sets dflash_config.causal
        causal=_causal(conf["transformer_layer_config"], {"causal": not conf.get("sliding_window_non_causal", True)}),
        num_speculative_tokens=n,  # speculators/base.py:120-126 (when the head is passed as --model)
        taps=conf["conv_kernel_size"], group=conf["conv_group_size"],  # models/qwen3_dflash2.py:254-255
        rank=conf["selector_rank"], top_k=conf["selector_top_k"],  # models/qwen3_dflash2.py:534-535
    )
    # the convolution's block is the bonus slot plus the drafted ones (models/qwen3_dflash2.py:256-257)
    v["conv_block"] = lambda num_spec: 1 + num_spec
    v["has_d2t"] = v["Vd"] != target_vocab  # models/qwen3_dflash.py:898-904
    return v


def dspark_view(conf: dict, target_vocab: int) -> dict:
    v = _layer_view(conf)
    v.update(
        method="dspark",  # dspark/config.py:21
        Vd=conf.get("draft_vocab_size") or v["V"],  # models/qwen3_dspark.py:207-209
        tH=conf.get("target_hidden_size") or v["H"],
        aux=[i + 1 for i in conf["target_layer_ids"]],  # eagle3_utils.py:127-130
        target_layer_ids=list(conf["target_layer_ids"]),
        mask_token_id=conf["mask_token_id"],
        markov_rank=conf["markov_rank"],
        confidence=bool(conf.get("enable_confidence_head", False)),  # models/qwen3_dspark.py:221
        conf_markov=bool(conf.get("confidence_head_with_markov", False)),  # :222
        sample_from_anchor=conf.get("sample_from_anchor", True),  # dspark/speculator.py:62-64
        causal=_causal(conf, conf.get("dflash_config") or {}),
        default_num_speculative_tokens=conf["block_size"],  # dspark/config.py:78-85
    )
    # query slots per request: N with sample_from_anchor, else N + 1 (dspark/speculator.py:65-68)
    v["query_slots"] = lambda num_spec: num_spec + (0 if v["sample_from_anchor"] else 1)
    v["has_d2t"] = v["Vd"] < target_vocab  # models/qwen3_dspark.py:267-273
    return v


def xpress_view(conf: dict, target_vocab: int) -> dict:
    v = _layer_view(conf)
    v.update(
        method="dflash",  # XPressSpeculatorConfig keeps DFlash's base method (xpress/config.py:7, dflash/config.py:15)
        Vd=conf.get("draft_vocab_size") or v["V"],
        tH=conf.get("target_hidden_size") or v["H"],
        aux=[i + 1 for i in conf["target_layer_ids"]], target_layer_ids=list(conf["target_layer_ids"]),
        mask_token_id=conf["mask_token_id"],
        B=conf.get("xpress_block_size") or 16,  # models/qwen3_xpress.py:273-274 (num_speculative_steps 15 + 1)
        r=conf.get("xpress_rank", 256), m=conf.get("xpress_mlp_hidden", 512),  # :275-276
        passes=conf.get("xpress_num_passes", 6), topc=conf.get("xpress_topc", 512),  # speculator.py:38, :278
        sample_from_anchor=conf.get("sample_from_anchor", False),
        causal=_causal(conf, conf.get("dflash_config") or {}),
    )
    v["has_d2t"] = False
    v["full_vocab"] = v["Vd"] == target_vocab  # models/qwen3_xpress.py:317-322
    # the refiner's kernel takes the block from the query slots (xpress/kernels.py:207: B = blk.shape[1],
    # blk [N, 1 + num_speculative_steps], xpress/speculator.py:36, models/qwen3_xpress.py:132) while mix.L is
    # [r, B, B] for xpress_block_size (:55, indexed with stride B at kernels.py:149-151): they must agree
    v["query_slots"] = lambda num_spec: 1 + num_spec
    # slot 0's previous token is the anchor (xpress/speculator.py:87-90; kernels.py:136-138)
    v["slot0_prev"] = "anchor"
    return v

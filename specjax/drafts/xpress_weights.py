"""The weights XPress adds to the DFlash block drafter: the causal refiner head (plain Python, no jax).

XPRESS_WEIGHTS = DFLASH_WEIGHTS (specjax.drafts.dflash_weights) + these rows, named as speculators
0.9's XPressDraftModel names its `refiner_head` (r = xpress_rank, m = xpress_mlp_ratio, S = block_size):
  refiner_head.token_embed.weight  [V, r]      the previous token of each slot (target vocab ids)
  refiner_head.down_h.weight       [r, H]      the slot's final-normed state
  refiner_head.down_g.weight       [r, H]      the block's mean state
  refiner_head.in_proj.weight      [r, 3r]     [down_h ; down_g ; token] -> r
  refiner_head.mix_l               [r, S, S]   per-channel causal mixing over the block (lower triangle used)
  refiner_head.mlp_gate/up.weight  [r*m, r], mlp_down.weight [r, r*m]   a SwiGLU MLP in r-space
  refiner_head.readout.weight      [Vd, r]     the logit bias over the draft vocab
Kernels are stored HF [out, in]. specjax.drafts.xpress.init_draft_params starts mix_l at 0 (the
table's init is a placeholder), as speculators does.

XPRESS_VLLM034_WEIGHTS is the same table under vLLM 0.34's file names (its own XPress layout,
Qwen3XPressForCausalLM.load_weights in model_executor/models/qwen3_xpress.py:331-374, key map
:242-252): the backbone keeps DFlash's names, the refiner is `xpress_head.*` (VLLM034_REFINER_NAMES);
mix.L is the same raw [r, S, S] mixer (0.34 folds it to L*tril + I after loading, :86-95).
"""
from __future__ import annotations

import dataclasses

from specjax.drafts.dflash_weights import DFLASH_WEIGHTS
from specjax.drafts.weights import VD, Dim, DraftWeight, H

__all__ = ["REFINER_WEIGHTS", "VLLM034_REFINER_NAMES", "XPRESS_VLLM034_WEIGHTS", "XPRESS_WEIGHTS"]

VOCAB = Dim("V", lambda c: c.vocab_size)
R = Dim("r", lambda c: c.xpress_rank)
R3 = Dim("3r", lambda c: 3 * c.xpress_rank)
RM = Dim("r*m", lambda c: c.xpress_rank * c.xpress_mlp_ratio)
S = Dim("S", lambda c: c.block_size)

REFINER_WEIGHTS: tuple[DraftWeight, ...] = tuple(
    DraftWeight(f"refiner_head.{name}", f"refiner_head.{fname}", shape, axes, init, transpose)
    for name, fname, shape, axes, init, transpose in (
        ("token_embed.embedding", "token_embed.weight", (VOCAB, R), ("vocab", None),       "normal", False),
        ("down_h.kernel",         "down_h.weight",      (H, R),     ("embed", None),       "normal", True),
        ("down_g.kernel",         "down_g.weight",      (H, R),     ("embed", None),       "normal", True),
        ("in_proj.kernel",        "in_proj.weight",     (R3, R),    (None, None),          "normal", True),
        ("mix_l",                 "mix_l",              (R, S, S),  (None, None, None),    "normal", False),
        ("mlp_gate.kernel",       "mlp_gate.weight",    (R, RM),    (None, "mlp"),         "normal", True),
        ("mlp_up.kernel",         "mlp_up.weight",      (R, RM),    (None, "mlp"),         "normal", True),
        ("mlp_down.kernel",       "mlp_down.weight",    (RM, R),    ("mlp", None),         "normal", True),
        ("readout.kernel",        "readout.weight",     (R, VD),    (None, "draft_vocab"), "normal", True),
    )
)

XPRESS_WEIGHTS: tuple[DraftWeight, ...] = DFLASH_WEIGHTS + REFINER_WEIGHTS

# speculators' refiner file name -> vLLM 0.34's (qwen3_xpress.py:48-59 the modules, :242-252 the file keys)
VLLM034_REFINER_NAMES = {
    "refiner_head.token_embed.weight": "xpress_head.w1.weight",
    "refiner_head.down_h.weight": "xpress_head.down_h.weight",
    "refiner_head.down_g.weight": "xpress_head.down_g.weight",
    "refiner_head.in_proj.weight": "xpress_head.in_proj.weight",
    "refiner_head.mix_l": "xpress_head.mix.L",
    "refiner_head.mlp_gate.weight": "xpress_head.mlp.gate_proj.weight",
    "refiner_head.mlp_up.weight": "xpress_head.mlp.up_proj.weight",
    "refiner_head.mlp_down.weight": "xpress_head.mlp.down_proj.weight",
    "refiner_head.readout.weight": "xpress_head.w2.weight",
}

XPRESS_VLLM034_WEIGHTS: tuple[DraftWeight, ...] = DFLASH_WEIGHTS + tuple(
    dataclasses.replace(row, file_name=VLLM034_REFINER_NAMES[row.file_name]) for row in REFINER_WEIGHTS)

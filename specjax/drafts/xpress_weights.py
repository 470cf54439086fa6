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
"""
from __future__ import annotations

from specjax.drafts.dflash_weights import DFLASH_WEIGHTS
from specjax.drafts.weights import VD, Dim, DraftWeight, H

__all__ = ["REFINER_WEIGHTS", "XPRESS_WEIGHTS"]

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

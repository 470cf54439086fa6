"""The weights DFlash 2 adds to the DFlash block drafter, as table rows (plain Python, no jax: the
converters read it).

DFLASH2_WEIGHTS = DFLASH_WEIGHTS (specjax.drafts.dflash_weights: fc, hidden_norm, the Qwen3 decoder
layers, norm, lm_head) + these rows. File names are speculators 0.9's DFlash2DraftModel parameter
names, which vLLM 0.32's qwen3_dflash2 loader uses too:
  layers.{i}.attention_conv / layers.{i}.mlp_conv   the two-tap dynamic convolution around a sublayer:
      base_kernel                  [2, taps, H]       static taps; [0] for the sublayer's input, [1] for its output
      kernel_projection.weight     [2*taps*G, H]      the per-slot deltas (G = H / conv_group_size groups);
                                                      HF [out, in], read as (side, tap, group)
  candidate_selector.predecessor_codebook  [V, rank]  one row per target token (the token before a slot)
  candidate_selector.successor_codebook    [V, rank]  one row per candidate token
  candidate_selector.hidden_projection.weight [rank, H]  the final-normed slot state into the rank space
V is the target's vocab: DFlash 2 drafts over the full vocab (draft_vocab_size = vocab_size).
The init column is the table's default; specjax.drafts.dflash2.init_draft_params starts both
convolutions as the identity (base_kernel[:, 0] = 1, the rest and the projections 0), as speculators does.
"""
from __future__ import annotations

from specjax.drafts.dflash_weights import DFLASH_WEIGHTS, NUM_LAYERS
from specjax.drafts.weights import Dim, DraftWeight, H

__all__ = ["CONVS", "DFLASH2_WEIGHTS", "EXTRA_WEIGHTS"]

CONVS = ("attention_conv", "mlp_conv")  # around the attention sublayer, around the MLP
SIDES = Dim("2", lambda c: 2)  # input side, output side
TAPS = Dim("taps", lambda c: c.conv_kernel_size)
DELTAS = Dim("2*taps*G", lambda c: 2 * c.conv_kernel_size * (c.hidden_size // c.conv_group_size))
VOCAB = Dim("V", lambda c: c.vocab_size)
RANK = Dim("rank", lambda c: c.selector_rank)

EXTRA_WEIGHTS: tuple[DraftWeight, ...] = tuple(
    DraftWeight(f"layers.{{i}}.{conv}.{name}", f"layers.{{i}}.{conv}.{fname}", shape, axes, init, transpose,
                repeat=NUM_LAYERS)
    for conv in CONVS
    for name, fname, shape, axes, init, transpose in (
        ("base_kernel",              "base_kernel",              (SIDES, TAPS, H), (None, None, "norm"), "ones",   False),
        ("kernel_projection.kernel", "kernel_projection.weight", (H, DELTAS),      ("embed", None),      "normal", True),
    )
) + (
    DraftWeight("candidate_selector.predecessor_codebook", "candidate_selector.predecessor_codebook", (VOCAB, RANK),
                ("vocab", None), "normal", False),
    DraftWeight("candidate_selector.successor_codebook", "candidate_selector.successor_codebook", (VOCAB, RANK),
                ("vocab", None), "normal", False),
    DraftWeight("candidate_selector.hidden_projection.kernel", "candidate_selector.hidden_projection.weight",
                (H, RANK), ("embed", None), "normal", True),
)

DFLASH2_WEIGHTS: tuple[DraftWeight, ...] = DFLASH_WEIGHTS + EXTRA_WEIGHTS

"""The DSpark drafter's weights as one table (plain Python, no jax: the converters read it).

DSpark's backbone is DFlash's block drafter, so its rows are DFLASH_WEIGHTS (dflash_weights.py) and
then the two heads DSpark adds, under the names vLLM 0.32's qwen3_dspark loader (`Qwen3DSparkModel`:
`markov_head.markov_w1` an nn.Embedding, `markov_head.markov_w2` a bias-free projection,
`confidence_head.proj` a linear with bias) and speculators 0.9's `DSparkDraftModel` both give them:

  markov_head.markov_w1.weight   [V, r]       the previous token's (target vocab) rank-r code
  markov_head.markov_w2.weight   [Vd, r]      HF [out, in]: rank-r code -> draft-vocab logit bias
  confidence_head.proj.weight    [1, H (+r)]  HF [out, in]: [normed hidden, prev code] -> one logit
  confidence_head.proj.bias      [1]

speculators' two other Markov heads (config `markov_head_type`, MARKOV_HEAD_TYPES) add one linear
with bias each, under speculators' names (vLLM 0.32 builds neither):
  markov_head.gate_proj.weight   [r, H + r]   "gated": [normed hidden, prev code] -> the code's gate
  markov_head.gate_proj.bias     [r]
  markov_head.joint_proj.weight  [3r, 2r + H] "rnn": [state, prev code, normed hidden] -> [gate; candidate; output]
  markov_head.joint_proj.bias    [3r]

The confidence head exists when the config's `enable_confidence_head` is set; its input adds the
rank-r code when `confidence_head_with_markov` is (vLLM builds it with bias=True, as speculators'
nn.Linear has one). specjax.drafts.dspark derives init and logical axes from this table;
specjax_converters.dspark_export / dspark_validate / dspark_import the file names and shapes.
"""
from __future__ import annotations

from specjax.drafts.dflash_weights import DFLASH_VOCAB_TENSORS, DFLASH_WEIGHTS
from specjax.drafts.weights import VD, Dim, DraftWeight, H

__all__ = ["DSPARK_HEADS", "DSPARK_VOCAB_TENSORS", "DSPARK_WEIGHTS", "MARKOV_HEAD_TYPES"]

# speculators 0.9's markov_head_type values: the first-order bias, the hidden-gated bias, the recurrent one
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

RANK = Dim("r", lambda c: c.markov_rank)
VOCAB = Dim("V", lambda c: c.vocab_size)
CONF_IN = Dim("H(+r)", lambda c: c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0))
ONE = Dim("1", lambda c: 1)
GATE_IN = Dim("H+r", lambda c: c.hidden_size + c.markov_rank)
JOINT_IN = Dim("2r+H", lambda c: 2 * c.markov_rank + c.hidden_size)
JOINT_OUT = Dim("3r", lambda c: 3 * c.markov_rank)

# the rows DSpark adds to DFlash's backbone
DSPARK_HEADS: tuple[DraftWeight, ...] = (
    #           specjax param                        file name                        shape            logical axes              init      transpose
    DraftWeight("markov_head.markov_w1.embedding",   "markov_head.markov_w1.weight",  (VOCAB, RANK),   ("vocab", None),          "normal", False),
    DraftWeight("markov_head.markov_w2.kernel",      "markov_head.markov_w2.weight",  (RANK, VD),      (None, "draft_vocab"),    "normal", True),
    DraftWeight("markov_head.gate_proj.kernel",      "markov_head.gate_proj.weight",  (GATE_IN, RANK),  (None, None),           "normal", True,
                when="markov_gated"),
    DraftWeight("markov_head.gate_proj.bias",        "markov_head.gate_proj.bias",    (RANK,),          (None,),                "normal", False,
                when="markov_gated"),
    DraftWeight("markov_head.joint_proj.kernel",     "markov_head.joint_proj.weight", (JOINT_IN, JOINT_OUT), (None, None),      "normal", True,
                when="markov_rnn"),
    DraftWeight("markov_head.joint_proj.bias",       "markov_head.joint_proj.bias",   (JOINT_OUT,),     (None,),                "normal", False,
                when="markov_rnn"),
    DraftWeight("confidence_head.proj.kernel",       "confidence_head.proj.weight",   (CONF_IN, ONE),  (None, None),             "normal", True,
                when="enable_confidence_head"),
    DraftWeight("confidence_head.proj.bias",         "confidence_head.proj.bias",     (ONE,),          (None,),                  "normal", False,
                when="enable_confidence_head"),
)

DSPARK_WEIGHTS: tuple[DraftWeight, ...] = DFLASH_WEIGHTS + DSPARK_HEADS
DSPARK_VOCAB_TENSORS = DFLASH_VOCAB_TENSORS  # d2t / t2d, written when the draft vocab is smaller

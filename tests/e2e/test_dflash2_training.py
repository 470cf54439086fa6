"""draft.type=dflash2 end to end: the loop trains a DFlash 2 head (DFlash's block drafter with dynamic
convolutions and a candidate selector) on the tiny target (fp32, the jitted train step, 8 fake devices),
its loss falls over a few steps, the metrics carry both loss terms, run_meta.json names the family, the
export at the end is a speculators-layout DFlash2DraftModel folder the validator passes, specjax.eval
reads it back and decodes losslessly, serve_cmd prints vLLM's dflash method for it, and
`python -m specjax.export` re-exports the run from its checkpoint with the same weights."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import check_exported_block_head, inprocess_config  # noqa: E402

PROMPT = [3, 17, 25, 40, 8]


def test_dflash2_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.drafts.dflash2 import DFlash2Config
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics

    vocab = json.load(open(os.path.join(tiny_target, "config.json")))["vocab_size"]
    run = tmp_path / "run"
    head = train(inprocess_config(
        tiny_target, run, "draft.type=dflash2", "draft.block_size=4", f"draft.draft_vocab_size={vocab}",
        "draft.selector_rank=16", "draft.selector_top_k=8", "train.dflash_anchors=16", "optim.lr=3e-3",
        "optim.warmup_ratio=0.0", "train.steps=8", "export.at_end=true", "export.dtype=float32")).export_dir
    rows = read_metrics(str(run))
    losses = [r["loss"] for r in rows]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert {"unary_loss", "selector_loss", "recall", "accept_len", "acc_0"} <= set(rows[0])
    assert all(abs(r["loss"] - r["unary_loss"] - r["selector_loss"]) < 1e-4 * max(1.0, r["loss"]) for r in rows)

    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["speculators_model_type"] == "dflash2" and conf["block_size"] == 4
    check_exported_block_head(run, head, tiny_target, family="dflash2", layout="dflash2", config_type=DFlash2Config,
                              prompt=PROMPT)

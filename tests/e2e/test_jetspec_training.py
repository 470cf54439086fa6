"""draft.type=jetspec end to end: the loop trains a JetSpec head (DFlash's block drafter, causal inside
the block, forward KL to the target) on the tiny target (fp32, the jitted train step), its loss
falls over a few steps, run_meta.json names the family, the export at the end is a DFlash folder
with dflash_config.causal true that the validator passes, specjax.eval reads it back as a
JetSpecConfig and decodes losslessly, serve_cmd prints vLLM's dflash method for it, and
`python -m specjax.export` re-exports the run from its checkpoint with the same weights."""
import json
import os
import sys

from specjax.drafts.dflash import JetSpecConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import check_exported_block_head, inprocess_config  # noqa: E402

RUN = ("draft.type=jetspec", "draft.block_size=4", "train.dflash_anchors=16", "optim.lr=3e-3", "optim.warmup_ratio=0.0",
       "train.steps=8", "export.at_end=true", "export.dtype=float32")
PROMPT = [3, 17, 25, 40, 8]


def test_jetspec_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics

    run = tmp_path / "run"
    head = train(inprocess_config(tiny_target, run, *RUN)).export_dir
    losses = [r["loss"] for r in read_metrics(str(run))]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]), losses

    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["dflash_config"]["causal"] is True and conf["block_size"] == 4
    again = check_exported_block_head(run, head, tiny_target, family="jetspec", layout="dflash",
                                      config_type=JetSpecConfig, prompt=PROMPT)
    assert json.load(open(os.path.join(again, "config.json")))["dflash_config"]["causal"] is True

"""draft.type=dspark end to end: the loop trains a DSpark head (DFlash's block backbone + the Markov and
confidence heads, forward KL + confidence BCE) on the tiny target (fp32, the jitted train step), its
loss falls over a few steps, run_meta.json names the family, the export at the end is a Qwen3DSparkModel
folder the validator passes, specjax.eval reads it back and decodes losslessly (greedy: the target's
own greedy tokens, with drafts of block_size tokens from the anchor), serve_cmd prints vLLM's dspark
method for it. Each of speculators' Markov heads (draft.markov_head_type vanilla, gated, rnn); serve_cmd
refuses the gated / rnn heads (vLLM 0.32 builds only the vanilla one)."""
import json
import os
import sys

import pytest

from specjax.drafts.dspark import DSparkConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

RUN = ("draft.type=dspark", "draft.block_size=3", "draft.markov_rank=8", "train.dflash_anchors=16", "optim.lr=3e-3",
       "optim.warmup_ratio=0.0", "train.steps=8", "export.at_end=true", "export.dtype=float32")
PROMPT = [3, 17, 25, 40, 8]


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_dspark_head_trains_exports_and_decodes(tiny_target, tmp_path, head_type):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.serve_cmd import build
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

    run = tmp_path / "run"
    head = train(inprocess_config(tiny_target, run, *RUN, f"draft.markov_head_type={head_type}")).export_dir
    records = read_metrics(str(run))
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert "confidence_loss" in records[-1] and "accept_rate" in records[-1]

    assert json.loads((run / "run_meta.json").read_text())["draft_family"] == "dspark"
    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["block_size"] == 3 and conf["sample_from_anchor"]
    assert conf["markov_head_type"] == head_type
    findings, info = validate_folder(head, target=tiny_target)
    assert info["layout"] == "dspark" and not errors(findings), [str(f) for f in findings]

    draft = load_draft(head)
    assert type(draft.config) is DSparkConfig and draft.config.num_draft_tokens == 3
    assert draft.config.markov_head_type == head_type
    target = load_target(tiny_target, dtype="float32")
    greedy = generate(target, [PROMPT], max_new_tokens=12)[0][:12]
    for k in (3, 2):
        assert SpecDecoder(target, draft, num_spec_tokens=k).generate(PROMPT, max_new_tokens=12).tokens == greedy

    code, text = build(head, tiny_target, engine="vllm")
    if head_type == "vanilla":
        assert code == 0 and '"method": "dspark"' in text and '"num_speculative_tokens": 3' in text, text
    else:
        assert code != 0 and "markov_head_type" in text and '"method"' not in text, text


def is_slow_case(test_name: str, params: dict) -> bool:
    """tests/conftest.py marks the gated and rnn runs slow: the default run keeps the vanilla run end to
    end, and tests/unit/test_dspark.py checks every head type against speculators and in the proposer."""
    return test_name == "test_dspark_head_trains_exports_and_decodes" and params["head_type"] != "vanilla"

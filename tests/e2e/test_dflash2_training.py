"""draft.type=dflash2 end to end: the loop trains a DFlash 2 head (DFlash's block drafter with dynamic
convolutions and a candidate selector) on the tiny target (fp32, the jitted train step, 8 fake devices),
its loss falls over a few steps, the metrics carry both loss terms, run_meta.json names the family, the
export at the end is a speculators-layout DFlash2DraftModel folder the validator passes, specjax.eval
reads it back and decodes losslessly, serve_cmd prints vLLM's dflash method for it, and
`python -m specjax.export` re-exports the run from its checkpoint with the same weights."""
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

PROMPT = [3, 17, 25, 40, 8]


def test_dflash2_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.drafts.dflash2 import DFlash2Config
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.export import export_run
    from specjax.serve_cmd import build
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

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

    assert json.loads((run / "run_meta.json").read_text())["draft_family"] == "dflash2"
    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["speculators_model_type"] == "dflash2" and conf["block_size"] == 4
    findings, info = validate_folder(head, target=tiny_target)
    assert info["layout"] == "dflash2" and not errors(findings), [str(f) for f in findings]

    draft = load_draft(head)
    assert type(draft.config) is DFlash2Config and draft.config.num_draft_tokens == 3
    target = load_target(tiny_target, dtype="float32")
    greedy = generate(target, [PROMPT], max_new_tokens=12)[0][:12]
    assert SpecDecoder(target, draft, num_spec_tokens=3).generate(PROMPT, max_new_tokens=12).tokens == greedy

    code, text = build(head, tiny_target, engine="vllm")
    assert code == 0 and '"method": "dflash"' in text and '"num_speculative_tokens": 3' in text, text

    again = export_run(str(run), str(tmp_path / "again"), dtype="float32")
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (head, again))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)

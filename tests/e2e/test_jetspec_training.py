"""draft.type=jetspec end to end: the loop trains a JetSpec head (DFlash's block drafter, causal inside
the block, forward KL to the target) on the tiny target (fp32, the jitted train step), its loss
falls over a few steps, run_meta.json names the family, the export at the end is a DFlash folder
with dflash_config.causal true that the validator passes, specjax.eval reads it back as a
JetSpecConfig and decodes losslessly, serve_cmd prints vLLM's dflash method for it, and
`python -m specjax.export` re-exports the run from its checkpoint with the same weights."""
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file

from specjax.drafts.dflash import JetSpecConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

RUN = ("draft.type=jetspec", "draft.block_size=4", "train.dflash_anchors=16", "optim.lr=3e-3", "optim.warmup_ratio=0.0",
       "train.steps=8", "export.at_end=true", "export.dtype=float32")
PROMPT = [3, 17, 25, 40, 8]


def test_jetspec_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.export import export_run
    from specjax.serve_cmd import build
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

    run = tmp_path / "run"
    head = train(inprocess_config(tiny_target, run, *RUN)).export_dir
    losses = [r["loss"] for r in read_metrics(str(run))]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]), losses

    assert json.loads((run / "run_meta.json").read_text())["draft_family"] == "jetspec"
    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["dflash_config"]["causal"] is True and conf["block_size"] == 4
    findings, info = validate_folder(head, target=tiny_target)
    assert info["layout"] == "dflash" and not errors(findings), [str(f) for f in findings]

    draft = load_draft(head)
    assert type(draft.config) is JetSpecConfig and draft.config.num_draft_tokens == 3
    target = load_target(tiny_target, dtype="float32")
    greedy = generate(target, [PROMPT], max_new_tokens=12)[0][:12]
    assert SpecDecoder(target, draft, num_spec_tokens=3).generate(PROMPT, max_new_tokens=12).tokens == greedy

    code, text = build(head, tiny_target, engine="vllm")
    assert code == 0 and '"method": "dflash"' in text and '"num_speculative_tokens": 3' in text, text

    again = export_run(str(run), str(tmp_path / "again"), dtype="float32")
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (head, again))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)
    assert json.load(open(os.path.join(again, "config.json")))["dflash_config"]["causal"] is True

"""draft.type=xpress end to end: the loop trains an XPress head (DFlash's block drafter plus the causal
refiner) on the tiny target (fp32, the jitted train step, 8 fake devices) with a reduced draft vocab, its
loss falls over a few steps, the metrics carry the three loss terms, run_meta.json names the family,
the export at the end is a speculators-layout XPress folder the validator passes, and specjax.eval
reads it back and decodes losslessly after its Jacobi passes. With draft.xpress_slot0_prev=anchor the
export is vLLM 0.34's own XPress layout instead, read back the same way."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

PROMPT = [3, 17, 25, 40, 8]


def test_xpress_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.drafts.xpress import XPressConfig
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

    run = tmp_path / "run"
    head = train(inprocess_config(
        tiny_target, run, "draft.type=xpress", "draft.block_size=4", "draft.draft_vocab_size=128",
        "draft.xpress_rank=16", "draft.num_jacobi_passes=2", "train.dflash_anchors=16", "optim.lr=3e-3",
        "optim.warmup_ratio=0.0", "train.steps=8", "export.at_end=true", "export.dtype=float32")).export_dir
    rows = read_metrics(str(run))
    losses = [r["loss"] for r in rows]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert {"tf_loss", "consistency_loss", "base_loss", "accept_len", "acc_0"} <= set(rows[0])

    assert json.loads((run / "run_meta.json").read_text())["draft_family"] == "xpress"
    findings, info = validate_folder(head, target=tiny_target)
    assert info["layout"] == "xpress" and not errors(findings), [str(f) for f in findings]
    draft = load_draft(head)
    assert type(draft.config) is XPressConfig and draft.config.num_jacobi_passes == 2
    target = load_target(tiny_target, dtype="float32")
    greedy = generate(target, [PROMPT], max_new_tokens=12)[0][:12]
    assert SpecDecoder(target, draft, num_spec_tokens=3).generate(PROMPT, max_new_tokens=12).tokens == greedy


def test_xpress_anchor_head_trains_and_exports_vllm034_layout(tiny_target, tmp_path):
    """draft.xpress_slot0_prev=anchor (vLLM 0.34's slot-0 convention, full draft vocab): the loop trains
    it, the export at the end is 0.34's own layout (Qwen3XPressModel) the validator passes, serve_cmd's
    speculative config is 0.34's (method dflash, block_size - 1 tokens), and specjax.eval reads it back
    with the same convention and decodes losslessly."""
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.serve_cmd import vllm_speculative_config
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax_converters.head_formats import errors, validate_folder

    vocab = json.load(open(os.path.join(tiny_target, "config.json")))["vocab_size"]
    run = tmp_path / "run"
    head = train(inprocess_config(
        tiny_target, run, "draft.type=xpress", "draft.block_size=4", f"draft.draft_vocab_size={vocab}",
        "draft.xpress_rank=16", "draft.num_jacobi_passes=2", "draft.xpress_slot0_prev=anchor",
        "train.dflash_anchors=16", "optim.lr=3e-3", "optim.warmup_ratio=0.0", "train.steps=4", "export.at_end=true",
        "export.dtype=float32")).export_dir
    findings, info = validate_folder(head, target=tiny_target)
    assert info["layout"] == "xpress_vllm034" and not errors(findings), [str(f) for f in findings]
    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["architectures"] == ["Qwen3XPressModel"] and conf["xpress_topc"] == 0
    assert vllm_speculative_config(head, 3) == {"method": "dflash", "model": head, "num_speculative_tokens": 3}
    draft = load_draft(head)
    assert draft.config.xpress_slot0_prev == "anchor" and draft.config.draft_vocab_size == vocab
    target = load_target(tiny_target, dtype="float32")
    greedy = generate(target, [PROMPT], max_new_tokens=12)[0][:12]
    assert SpecDecoder(target, draft, num_spec_tokens=3).generate(PROMPT, max_new_tokens=12).tokens == greedy

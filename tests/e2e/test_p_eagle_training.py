"""draft.type=p_eagle end to end: the loop trains a P-EAGLE head on the tiny target (8 fake devices,
fp32) with COD row sampling, the metrics show depth 0 and a later depth learning and the COD row
counts shrinking with depth, the export validates (mask_token_id in config.json, mask_hidden in the
weights, the parallel-drafting warning), and specjax.eval reads it back as a P-EAGLE draft that
decodes losslessly in one parallel forward per step."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402


def test_p_eagle_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

    res = train(inprocess_config(tiny_target, tmp_path / "run", "draft.type=p_eagle", "draft.ttt_steps=3",
                                 "draft.step_decay=1.0", "train.steps=8", "export.at_end=true", "optim.lr=3e-3",
                                 "optim.warmup_ratio=0.0"))
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 8
    late = lambda key: sum(r[key] for r in rows[-3:]) / 3  # per-batch accuracy is noisy
    assert late("acc_0") > rows[0]["acc_0"] + 0.1 and late("acc_1") > rows[0]["acc_1"] + 0.1
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[0]["cod_rows_0"] > rows[0]["cod_rows_1"] > rows[0]["cod_rows_2"] > 0
    findings, _ = validate_folder(res.export_dir)
    assert errors(findings) == []
    assert any(f.rule == "config.parallel_drafting" for f in findings)
    conf = json.load(open(os.path.join(res.export_dir, "config.json")))
    target_conf = json.load(open(os.path.join(tiny_target, "config.json")))
    want_mask = target_conf.get("pad_token_id")
    if want_mask is None:
        want_mask = target_conf["eos_token_id"]
    assert conf["mask_token_id"] == (want_mask[0] if isinstance(want_mask, list) else want_mask)
    draft = load_draft(res.export_dir)
    assert draft.config.parallel_drafting and draft.params["mask_hidden"].shape[-1] == 3 * draft.config.hidden_size
    target = load_target(tiny_target, dtype="float32")
    prompt = [3, 17, 25, 40, 8]
    want = generate(target, [prompt], max_new_tokens=10)[0]
    assert SpecDecoder(target, draft, num_spec_tokens=3).generate(prompt, max_new_tokens=10).tokens == want[:10]

"""draft.num_layers=2 end to end: the loop trains a two-layer head on the tiny target (8 fake devices,
fp32), exports it, the export validates with no error (the multi-layer warning names SGLang), and
specjax.eval's loader reads it back as a two-layer draft that decodes losslessly."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402


def test_two_layer_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

    res = train(inprocess_config(tiny_target, tmp_path / "run", "draft.num_layers=2", "train.steps=6",
                                 "export.at_end=true", "optim.lr=3e-3", "optim.warmup_ratio=0.0"))
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 6 and rows[-1]["acc_0"] > rows[0]["acc_0"] + 0.1  # it learns (per-batch loss is noisy)
    findings, _ = validate_folder(res.export_dir)
    assert errors(findings) == []
    assert any(f.rule == "config.num_hidden_layers" and f.level == "warning" for f in findings)
    draft = load_draft(res.export_dir)
    assert draft.config.num_layers == 2 and "layers" in draft.params
    target = load_target(tiny_target, dtype="float32")
    prompt = [3, 17, 25, 40, 8]
    want = generate(target, [prompt], max_new_tokens=10)[0]
    assert SpecDecoder(target, draft, num_spec_tokens=3).generate(prompt, max_new_tokens=10).tokens == want[:10]

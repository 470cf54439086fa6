"""draft.type=dflash end to end: the loop trains a DFlash block drafter on the tiny target (8 fake
devices, fp32) through the same jitted step, the metrics show its drafted slots learning (averaged
over the last steps: per-batch accuracy is noisy), the export at the end is a DFlash folder (vLLM's
config keys, the mask token from the target's pad/eos, block_size), specjax.eval reads it back and
decodes losslessly with block_size - 1 drafts per step, the DFlash validator passes it (with its
manifest), and `python -m specjax.export` re-exports the run from its checkpoint with the same weights. A stop_at_step run resumed to the end trains
the same params as the uninterrupted one (the anchor draw is keyed by the step, not by state)."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

DFLASH = ("draft.type=dflash", "draft.block_size=4", "train.dflash_anchors=16", "optim.lr=3e-3",
          "optim.warmup_ratio=0.0")


def _weights(folder):
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_dflash_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.export import export_run
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics

    res = train(inprocess_config(tiny_target, tmp_path / "run", *DFLASH, "train.steps=10", "export.at_end=true",
                                 "export.dtype=float32"))
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 10
    late = lambda key: sum(r[key] for r in rows[-3:]) / 3  # noqa: E731
    assert late("acc_0") > rows[0]["acc_0"] + 0.1 and late("acc") > rows[0]["acc"] + 0.05
    assert late("accept_len") > rows[0]["accept_len"]
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])
    assert {"acc_0", "acc_1", "acc_2", "slot_tokens_0", "num_blocks", "grad_norm"} <= set(rows[0])
    assert "acc_3" not in rows[0]  # block_size 4: slots 1..3 draft, slot 0 is the anchor

    conf = json.load(open(os.path.join(res.export_dir, "config.json")))
    target_conf = json.load(open(os.path.join(tiny_target, "config.json")))
    want_mask = target_conf.get("pad_token_id")
    if want_mask is None:
        want_mask = target_conf["eos_token_id"]
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["block_size"] == 4
    assert conf["dflash_config"]["mask_token_id"] == (want_mask[0] if isinstance(want_mask, list) else want_mask)
    assert conf["dflash_config"]["target_layer_ids"] == [target_conf["num_hidden_layers"] // 2]  # one draft layer
    meta = json.load(open(tmp_path / "run" / "run_meta.json"))
    assert meta["draft_family"] == "dflash" and meta["draft_config"]["block_size"] == 4
    from specjax_converters.head_formats import errors, validate_folder

    findings, info = validate_folder(res.export_dir, target=tiny_target)  # the DFlash rules, not EAGLE-3's
    assert info["layout"] == "dflash" and not errors(findings), [str(f) for f in findings]
    manifest = json.load(open(os.path.join(res.export_dir, "specjax_manifest.json")))
    assert manifest["variant"] == "dflash" and manifest["step"] == 10 and "config" in manifest

    draft = load_draft(res.export_dir)
    assert draft.config.block_size == 4 and draft.config.num_draft_tokens == 3
    target = load_target(tiny_target, dtype="float32")
    prompt = [3, 17, 25, 40, 8]
    want = generate(target, [prompt], max_new_tokens=12)[0]
    out = SpecDecoder(target, draft, num_spec_tokens=3).generate(prompt, max_new_tokens=12)
    assert out.tokens == want[:12]

    from specjax.serve_cmd import build, vllm_speculative_config

    assert vllm_speculative_config(res.export_dir, 7) == {"method": "dflash", "model": res.export_dir,
                                                          "num_speculative_tokens": 3}
    code, text = build(res.export_dir, tiny_target, engine="vllm")
    assert code == 0 and '"method": "dflash"' in text and '"num_speculative_tokens": 3' in text, text

    again = export_run(str(tmp_path / "run"), str(tmp_path / "again"), dtype="float32")
    a, b = _weights(res.export_dir), _weights(again)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_dflash_resume_matches_uninterrupted(tiny_target, tmp_path):
    from specjax.train.loop import train

    base = (*DFLASH, "train.steps=4", "checkpoint.every_steps=2", "export.at_end=true", "export.dtype=float32")
    whole = train(inprocess_config(tiny_target, tmp_path / "whole", *base))
    first = train(inprocess_config(tiny_target, tmp_path / "split", *base, "train.stop_at_step=2"))
    assert first.stopped_early and first.final_step == 2 and first.export_dir is None
    rest = train(inprocess_config(tiny_target, tmp_path / "split", *base))
    assert rest.final_step == 4
    a, b = _weights(whole.export_dir), _weights(rest.export_dir)
    assert all(np.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_dflash_settings_are_checked_when_the_config_loads():
    import pytest

    from specjax.config import ConfigError, load_config

    load_config(None, ["draft.type=dflash", "draft.block_size=2", "train.dflash_objective=token_ce"])
    load_config(None, ["draft.type=dflash", "draft.init_from=/x"])  # warm starts from a DFlash export
    for overrides, match in (
            (["draft.type=dflash", "draft.block_size=1"], "draft.block_size"),
            (["draft.type=dflash", "train.dflash_objective=ce"], "dflash_objective"),
            (["draft.type=dflash", "train.dflash_anchors=0"], "dflash_anchors"),
            (["draft.type=dflash", "draft.fc_norm=true"], "draft.fc_norm"),
            (["draft.type=dflash", "train.loss=lk_alpha"], "train.dflash_objective"),
            (["draft.type=dflash", "draft.sample_from_anchor=true", "train.dflash_objective=token_ce"], "slot 0"),
            (["draft.type=dflash", "draft.block_size=4", "decode_eval.at_end=true", "decode_eval.num_spec_tokens=5"],
             "decode_eval.num_spec_tokens"),
            (["draft.block_size=8"], r"`draft.block_size` is not a key of draft.type=eagle3 \(EAGLE-3\); it belongs to "
             r"draft.type=dflash or draft.type=jetspec or draft.type=dspark or draft.type=dflash2 or "
             r"draft.type=xpress. Fix: remove it or set draft.type=dflash"),
            (["draft.type=p_eagle", "train.dflash_anchors=8"], r"`train.dflash_anchors` = 8 is not read by "
             r"draft.type=p_eagle .* it is read by draft.type=dflash")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)

"""The bad-input catalogue at the level of a whole run: each case fails fast with a message that
names the problem and the fix (or is skipped and counted). Data-row cases are in tests/data, target
folder cases in tests/parity/test_targets_hf.py, config cases in tests/unit/test_config.py."""
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from specjax import checkpoint as ckpt
from specjax.train.loop import NonFiniteTrainingError, train

from _runs import inprocess_config


def cfg(target, out, *extra):
    return inprocess_config(target, out, *extra)


def test_draft_vocab_larger_than_target_vocab(tiny_target, tmp_path):
    # found from the target's config.json, before the data pass (train.setup.check_draft_fits_target)
    with pytest.raises(ValueError, match=re.escape(
            "draft.draft_vocab_size=100000 is larger than the target's vocab (320 tokens in ") +
            r".*config\.json\); set draft\.draft_vocab_size <= 320\."):
        train(cfg(tiny_target, tmp_path / "o", "draft.draft_vocab_size=100000"))


@pytest.mark.parametrize("ids,msg", [
    ("[1,2,99]", "aux_layer_ids (1, 2, 99) out of range: valid ids are 0..3 (output of decoder layer k, 4 layers)"),
    ("[2,1,3]", "aux_layer_ids (2, 1, 3) must be strictly increasing (valid range 0..3)"),
], ids=["out_of_range", "not_increasing"])
def test_aux_layer_ids_out_of_range_or_not_increasing(tiny_target, tmp_path, ids, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        train(cfg(tiny_target, tmp_path / "o", f"target.aux_layer_ids={ids}"))


def test_tokenizer_larger_than_target_vocab(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.add_tokens([f"<extra_{i}>" for i in range(200)])  # now larger than the target's vocab
    tok.save_pretrained(tmp_path / "big_tok")
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the target's vocab_size is \d+"):
        train(cfg(tiny_target, tmp_path / "o", f"data.tokenizer={tmp_path / 'big_tok'}"))


def test_chat_template_missing(tiny_target, tmp_path):
    t = tmp_path / "t"
    shutil.copytree(tiny_target, t)
    os.remove(t / "chat_template.jinja")
    tc = json.loads((t / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ValueError, match="data.chat_template"):
        train(cfg(str(t), tmp_path / "o"))


def test_output_dir_not_writable(tiny_target, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="run.output_dir .* is not writable"):
        train(cfg(tiny_target, blocker / "sub"))


def test_empty_target_path_and_missing_weights(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="target.path is empty"):
        train(cfg("", tmp_path / "o"))
    t = tmp_path / "noweights"
    shutil.copytree(tiny_target, t)
    os.remove(t / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"no model.safetensors or model.safetensors.index.json in {t} (only safetensors checkpoints load)")):
        train(cfg(str(t), tmp_path / "o2"))


def test_pickle_weights_are_refused(tiny_target, tmp_path):
    t = tmp_path / "pickled"
    shutil.copytree(tiny_target, t)
    os.rename(t / "model.safetensors", t / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"no model.safetensors or model.safetensors.index.json in {t} (only safetensors checkpoints load)")):
        train(cfg(str(t), tmp_path / "o"))


def test_missing_data_file_and_empty_list(tiny_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        train(cfg(tiny_target, tmp_path / "o", f"data.train_files=[{tmp_path}/nope.jsonl]"))
    with pytest.raises(ValueError, match="data.train_files is empty"):
        train(cfg(tiny_target, tmp_path / "o2", "data.train_files=[]"))


def test_no_usable_rows(tiny_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n\xff\xfe\n')
    with pytest.raises(ValueError, match="no usable training example"):
        train(cfg(tiny_target, tmp_path / "o", f"data.train_files=[{bad}]"))


def test_bad_rows_are_skipped_counted_and_located(tiny_target, tmp_path, caplog):
    src = os.path.join(os.path.dirname(__import__("specjax").__file__), "assets", "demo_chat.jsonl")
    mixed = tmp_path / "mixed.jsonl"
    good = open(src, encoding="utf-8").read().splitlines()[:100]
    mixed.write_text("\n".join(good[:50] + ["{broken", '{"messages": [{"role": "robot", "content": "x"}]}']
                               + good[50:]) + "\n")
    caplog.set_level("WARNING")
    train(cfg(tiny_target, tmp_path / "o", f"data.train_files=[{mixed}]", "data.seq_length=256"))
    text = caplog.text
    assert "mixed.jsonl:51" in text and "mixed.jsonl:52" in text and "skipped 2" in text


def test_batch_not_divisible_by_mesh(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="data.batch_size=6 must be divisible"):
        train(cfg(tiny_target, tmp_path / "o", "data.batch_size=6"))


def test_checkpoint_from_a_different_config_is_refused_with_a_diff(tiny_target, tmp_path):
    out = tmp_path / "o"
    train(cfg(tiny_target, out))
    # the first run saved its final step (2); the diff names each tensor whose shape changed, and the fix
    with pytest.raises(ckpt.CheckpointMismatch, match=(
            rf"(?s)^checkpoint {re.escape(str(out))}/checkpoints/2 was written by a different configuration:\n"
            r".*\n  params\.midlayer\.mlp\.gate_proj\.kernel: checkpoint \(32, 64\) != this config \(32, 48\)\n"
            r".*\nUse a new run\.output_dir, or set checkpoint\.restore_from=none to start fresh\.$")):
        train(cfg(tiny_target, out, "draft.intermediate_size=48", "train.steps=4"))


def test_restore_from_missing_checkpoint(tiny_target, tmp_path):
    def expected(path):
        return re.escape(f"checkpoint.restore_from='{path}' is not a saved checkpoint; give a "
                         "<run>/checkpoints/<step> folder, 'latest' (default) or 'none'.")

    missing = f"{tmp_path}/ckpts/7"  # a step folder that does not exist
    with pytest.raises(FileNotFoundError, match=expected(missing)):
        train(cfg(tiny_target, tmp_path / "o", f"checkpoint.restore_from={missing}"))
    not_a_step = tmp_path / "ckpts"  # exists, but is not a <step> folder
    not_a_step.mkdir()
    with pytest.raises(FileNotFoundError, match=expected(not_a_step)):
        train(cfg(tiny_target, tmp_path / "o2", f"checkpoint.restore_from={not_a_step}"))


def test_non_finite_steps_are_skipped_then_stop(tiny_target, tmp_path, caplog):
    # poison the target: every embedding row NaN -> every loss NaN
    t = tmp_path / "nan_target"
    shutil.copytree(tiny_target, t)
    from safetensors.numpy import load_file, save_file

    w = load_file(str(t / "model.safetensors"))
    w["model.embed_tokens.weight"] = np.full_like(w["model.embed_tokens.weight"], np.nan)
    save_file(w, str(t / "model.safetensors"), metadata={"format": "pt"})
    caplog.set_level("WARNING")
    with pytest.raises(NonFiniteTrainingError, match=(
            r"^3 consecutive steps \(up to step 3\) had a non-finite loss or gradient, so training stopped; "
            rf"the last good state is checkpointed in {re.escape(str(tmp_path / 'o' / 'checkpoints'))}\. "
            r"Likely causes: optim\.lr too high \(now 0\.0001\) or no/too-loose optim\.grad_clip \(now 0\.5\); "
            r"bad data in the rows of the last batch \['[^']*demo_chat\.jsonl:\d+'")):
        train(cfg(str(t), tmp_path / "o", "train.steps=10", "train.max_consecutive_skips=3"))
    assert "step 1: non-finite loss or gradient; update skipped" in caplog.text and "demo_chat.jsonl:" in caplog.text
    mngr = ckpt.manager(str(tmp_path / "o" / "checkpoints"), read_only=True)
    # stopped with a checkpoint: each step's skip flag is read one step late, so the 3rd skip
    # (step 3) is seen after step 4 ran (also skipped, params unchanged) and step 4 is saved
    assert mngr.latest_step() == 4


def test_skipped_step_leaves_params_bitwise_unchanged(tiny_target):
    """The guard inside the jitted step: a NaN batch changes nothing, a finite one updates."""
    import jax.numpy as jnp

    from specjax import mesh as meshlib
    from specjax.drafts import eagle3
    from specjax.drafts.ttt import TTTConfig
    from specjax.targets import load_target
    from specjax.train.optim import make_optimizer
    from specjax.train.step import build_step_fns, init_state
    from specjax.config import OptimConfig

    target = load_target(tiny_target, dtype="float32")
    dcfg = eagle3.config_from_target(target.config, draft_vocab_size=32, aux_layer_ids=(1, 2, 3))
    params = eagle3.init_draft_params(dcfg, jax.random.key(0))
    opt = make_optimizer(OptimConfig(lr=1e-2), 10)
    mesh = meshlib.make_mesh({"data": 1}, jax.devices()[:1])
    fns = build_step_fns(target, target.params, params, dcfg, TTTConfig(ttt_steps=2), opt, mesh)
    vocab = {"draft_ids": jnp.arange(32), "t2d": jnp.arange(target.config.vocab_size) < 32, "d2t": jnp.zeros(32, jnp.int32)}
    batch = {"input_ids": jnp.arange(16, dtype=jnp.int32)[None] % 30, "loss_mask": jnp.ones((1, 16), jnp.int32),
             "segment_ids": jnp.ones((1, 16), jnp.int32), "positions": jnp.arange(16, dtype=jnp.int32)[None]}
    poisoned = jax.tree_util.tree_map(lambda x: x, target.params)
    poisoned["embed_tokens"]["embedding"] = jnp.full_like(target.params["embed_tokens"]["embedding"], jnp.nan)
    state = init_state(params, opt)
    before = jax.tree_util.tree_map(np.asarray, state["params"])
    state, m = fns.train_step(state, poisoned, vocab, batch)
    assert float(m["skipped"]) == 1.0
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state["params"], before)
    state, m = fns.train_step(state, target.params, vocab, batch)
    assert float(m["skipped"]) == 0.0
    changed = jax.tree_util.tree_map(lambda a, b: bool(np.any(np.asarray(a) != b)), state["params"], before)
    assert all(jax.tree_util.tree_leaves(changed))

"""Training controls.

train.grad_accum_steps: the step splits data.batch_size rows into n micro-batches computed in turn and
applies their mean gradient once. On the same data, a run with n = 4 (micro-batches of 8 rows over the 8
fake devices) matches the run with the whole 32-row batch at every step: loss and gradient norm within
1e-5 relative (fp32; EAGLE-3's loss is normalised by rows x length, so the mean of the micro-batch
losses is the whole batch's loss; only the order of the sums differs). A split that leaves a device
without whole rows of a micro-batch is refused before anything loads.

draft.vocab_file: a run given another run's draft_vocab.npz uses exactly that map (not its own data's
counts) and saves it as its own; a file for another vocabulary size is refused naming the fix.

data.val_files: validation examples are exactly those files' rows (the training files are not split,
val_fraction is not used), skipped rows of both are in one skipped_rows.jsonl, and the run validates
on them.

data.train_file_weights: with weights 3 and 1 on two files the packed stream carries their examples
3 : 1 (grain's deterministic mix: within 2% over 400 examples), each file's examples reshuffled on
their own; the iterator resumes from its saved state to the same batches; a weight list of the
wrong length, a weight <= 0, or weights with a state cache are refused."""
import numpy as np
import pytest

from specjax.config import load_config
from specjax.train.metrics import read_metrics


def _cfg(target, out, *extra):
    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=200",
        "data.seq_length=128", "data.batch_size=32", "data.val_fraction=0.0",
        "draft.ttt_steps=2", "draft.draft_vocab_size=128", "optim.lr=3e-3", "optim.warmup_ratio=0.0",
        "train.steps=3", "train.log_every=1", "train.eval_batches=0", "train.eval_every=0",
        "train.progress=false", "checkpoint.every_steps=100", "export.at_end=false", *extra,
    ])


def test_accumulated_micro_batches_equal_the_whole_batch(tiny_target, tmp_path):
    from specjax.train.loop import train

    train(_cfg(tiny_target, tmp_path / "whole"))
    train(_cfg(tiny_target, tmp_path / "micro", "train.grad_accum_steps=4"))
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "whole"), "train")}
    b = {r["step"]: r for r in read_metrics(str(tmp_path / "micro"), "train")}
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(b[step][key], a[step][key], rtol=1e-5, err_msg=f"{key} at step {step}")
    assert a[3]["loss"] != a[1]["loss"]  # the steps moved the params


def test_a_split_without_whole_rows_per_device_is_refused(tiny_target, tmp_path):
    from specjax.train.loop import train

    with pytest.raises(ValueError, match=r"train.grad_accum_steps=8 micro-batches gives micro-batches of 4 rows.*"
                                         r"multiple of 64"):
        train(_cfg(tiny_target, tmp_path / "r", "train.grad_accum_steps=8"))


def test_micro_batches_lower_the_step_temporaries(tiny_target, tmp_path):
    """What accumulation is for: XLA's temporaries of the step (activations of one micro-batch live at a
    time) shrink with 4 micro-batches."""
    from specjax.train.aot import compile_step

    whole = compile_step(_cfg(tiny_target, tmp_path / "a"))
    micro = compile_step(_cfg(tiny_target, tmp_path / "b", "train.grad_accum_steps=4"))
    assert micro["temp_size_in_bytes"] < 0.6 * whole["temp_size_in_bytes"], (micro["temp_size_in_bytes"],
                                                                                whole["temp_size_in_bytes"])


def test_a_shared_draft_vocab_file_is_used_as_given(tiny_target, tmp_path):
    from specjax.drafts.vocab import DraftVocab
    from specjax.train.loop import train

    one_step = ("train.steps=1", "data.batch_size=8", "data.max_rows=60")
    train(_cfg(tiny_target, tmp_path / "a", *one_step))
    shared = tmp_path / "a" / "draft_vocab.npz"
    # other data (later rows of the file): counted, it would give another map
    other = ("data.max_rows=200", "data.shuffle_seed=5")
    train(_cfg(tiny_target, tmp_path / "own", *one_step[:2], *other))
    train(_cfg(tiny_target, tmp_path / "b", *one_step[:2], *other, f"draft.vocab_file={shared}"))
    a, own, b = (DraftVocab.load(tmp_path / d / "draft_vocab.npz") for d in ("a", "own", "b"))
    assert not np.array_equal(a.draft_ids, own.draft_ids)
    np.testing.assert_array_equal(b.draft_ids, a.draft_ids)
    np.testing.assert_array_equal(b.d2t, a.d2t)
    with pytest.raises(ValueError, match=r"draft.vocab_file .* to 128 draft tokens.*draft.draft_vocab_size=64.*"
                                         r"Fix: set draft.draft_vocab_size=128"):
        train(_cfg(tiny_target, tmp_path / "c", *one_step, "draft.draft_vocab_size=64", f"draft.vocab_file={shared}"))
    with pytest.raises(FileNotFoundError, match="draft.vocab_file .* does not exist"):
        train(_cfg(tiny_target, tmp_path / "d", *one_step, f"draft.vocab_file={tmp_path / 'none.npz'}"))


def test_validation_files_replace_the_split(tiny_target, tmp_path):
    import json

    from transformers import AutoTokenizer

    from specjax.data import prepare_examples
    from specjax.train.loop import train
    from specjax.train.run import prepare_training_examples
    from specjax.train.setup import resolve_path

    demo = resolve_path("pkg://specjax/assets/demo_chat.jsonl")
    lines = open(demo).read().splitlines()
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("\n".join(lines[300:307] + ['{"messages": []}']) + "\n")  # one bad row
    cfg = _cfg(tiny_target, tmp_path / "run", "data.max_rows=40", "data.val_fraction=0.5", f"data.val_files=[{val_file}]",
               "data.batch_size=8", "train.steps=1", "train.eval_batches=1", "train.eval_every=1")
    tok = AutoTokenizer.from_pretrained(tiny_target)
    (tmp_path / "run").mkdir()
    prep = prepare_training_examples(cfg, tok, str(tmp_path / "run"))
    whole = prepare_examples((demo,), tok, 128, 0.0, 0, max_rows=40)
    alone = prepare_examples((str(val_file),), tok, 128, 0.0, 0)
    assert [e.input_ids.tolist() for e in prep.train] == [e.input_ids.tolist() for e in whole.train]  # not split
    assert [e.input_ids.tolist() for e in prep.val] == [e.input_ids.tolist() for e in alone.train]
    assert len(prep.val) == 7
    skipped = [json.loads(x) for x in (tmp_path / "run" / "skipped_rows.jsonl").read_text().splitlines()]
    assert [s["file"] for s in skipped] == [str(val_file)]
    res = train(cfg)
    assert res.initial_val_metrics and np.isfinite(res.initial_val_metrics["loss"])


def test_file_weights_mix_the_training_files(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from specjax.data import make_train_iterator
    from specjax.train.loop import train
    from specjax.train.run import prepare_training_examples
    from specjax.train.setup import resolve_path

    lines = open(resolve_path("pkg://specjax/assets/demo_chat.jsonl")).read().splitlines()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:40]) + "\n")
    b.write_text("\n".join(lines[40:120]) + "\n")
    cfg = _cfg(tiny_target, tmp_path / "run", f"data.train_files=[{a},{b}]", "data.train_file_weights=[3,1]",
               "data.batch_size=8")
    (tmp_path / "run").mkdir()
    prep = prepare_training_examples(cfg, AutoTokenizer.from_pretrained(tiny_target), str(tmp_path / "run"))
    groups = [0 if ex.source == str(a) else 1 for ex in prep.train]
    assert groups.count(1) > 1.5 * groups.count(0)  # b has about twice as many examples as a ...
    it = make_train_iterator(prep.train, 128, 8, 0, groups=groups, weights=(3.0, 1.0))
    seen = []
    while len(seen) < 400:
        batch = next(it)
        for row in batch["example_ids"]:
            seen += [int(i) - 1 for i in dict.fromkeys(row.tolist()) if i > 0]
    share = np.mean([groups[i] == 0 for i in seen[:400]])
    assert abs(share - 0.75) < 0.02, share  # ... yet a's examples come 3 : 1
    state = it.get_state()
    want = [next(it)["input_ids"] for _ in range(3)]
    again = make_train_iterator(prep.train, 128, 8, 0, groups=groups, weights=(3.0, 1.0))
    again.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(again)["input_ids"], w)
    with pytest.raises(ValueError, match="has 1 weights for 2 data.train_files entries"):
        train(_cfg(tiny_target, tmp_path / "r1", f"data.train_files=[{a},{b}]", "data.train_file_weights=[1]"))
    with pytest.raises(ValueError, match="every weight must be > 0"):
        train(_cfg(tiny_target, tmp_path / "r2", f"data.train_files=[{a},{b}]", "data.train_file_weights=[1,0]"))
    with pytest.raises(ValueError, match="train_file_weights mixes the training files"):
        train(_cfg(tiny_target, tmp_path / "r3", f"data.train_files=[{a},{b}]", "data.train_file_weights=[1,1]",
                   "target.source=cache", f"target.cache_dir={tmp_path / 'c'}"))


def test_train_embedding(tiny_target, tmp_path, capsys):
    """draft.train_embedding: the draft owns a copy of the target's embedding, started from it (so the first
    step's loss equals a run on the target's, 1e-6) and trained (it moves; the target's does not); the
    export ships it as embed_tokens.weight, the head reads back with it (import and warm start), decoding
    embeds with it, and SGLang's serve command is marked unsupported (it replaces the embedding)."""
    from specjax.drafts.eagle3_family import draft_embedding
    from specjax.drafts.families import family_for_type
    from specjax.serve_cmd import main as serve_main
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax_converters.head_files import read_head_files

    base = train(_cfg(tiny_target, tmp_path / "frozen"))
    train(_cfg(tiny_target, tmp_path / "own", "draft.train_embedding=true", "export.at_end=true",
               "export.dtype=float32"))
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "frozen"), "train")}
    b = {r["step"]: r for r in read_metrics(str(tmp_path / "own"), "train")}
    np.testing.assert_allclose(b[1]["loss"], a[1]["loss"], rtol=1e-6)  # it starts as the target's
    assert b[3]["loss"] != a[3]["loss"]
    target = load_target(tiny_target, dtype="float32")
    table = np.asarray(target.embed_table(target.params))
    export = tmp_path / "own" / "export"
    _, tensors, manifest, _ = read_head_files(str(export))
    assert manifest["draft_config"]["train_embedding"] is True
    own = tensors.array("embed_tokens.weight")
    assert own.shape == table.shape and np.abs(own - table).max() > 1e-3  # trained, from the target's
    assert base.final_step == 3
    family = family_for_type("eagle3")
    head = family.load_head(str(export))
    assert head.config.train_embedding
    np.testing.assert_array_equal(head.params["embed_tokens"]["embedding"], tensors.array("embed_tokens.weight"))
    assert draft_embedding(head.params, table) is head.params["embed_tokens"]["embedding"]
    assert draft_embedding({}, table) is table

    # warm start: the head's embedding is kept; a run on the target's embedding refuses the head
    warm = train(_cfg(tiny_target, tmp_path / "warm", "draft.train_embedding=true", f"draft.init_from={export}",
                      "train.steps=1"))
    assert warm.final_step == 1
    with pytest.raises(ValueError, match="draft.train_embedding=true"):
        train(_cfg(tiny_target, tmp_path / "cold", f"draft.init_from={export}", "train.steps=1"))
    assert serve_main(["--draft", str(export), "--target", str(tiny_target), "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "UNSUPPORTED: SGLang replaces the head's trained embedding" in out, out

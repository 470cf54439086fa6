"""On-policy regeneration during training (regenerate.every_steps; specjax.train.regen_rounds).

Bars (CPU, the session's tiny target, 4 new tokens an answer):
  - the stream: a round's examples replace their indices from the items drawn after it (the next batch
    carries them, and once the packer's open rows are used up no old version comes back); a stream
    restored from its saved state (the grain position, the rounds and their stream positions) gives the
    same batches as the uninterrupted one, also when saved right after a round, while the packer's open
    rows still hold old versions;
  - a run: every 2 steps the target answers the next 16 training prompts (wrapping), the round is
    written to <run>/regen_rounds and logged (split `regen`: prompts, tokens, time), each train row
    carries regen_rounds / regen_examples; a run killed after round 2's answers were written but before
    its checkpoint, resumed from step 2 (round 1 read back from disk, round 2 from its shard), equals the
    uninterrupted run at every step (loss, acc_0, grad_norm; 1e-6);
  - no validation prompt is in any regenerated conversation;
  - settings that cannot work are refused naming the fix.
"""
import os
import shutil

import numpy as np
import pytest

from specjax.config import load_config
from specjax.train.metrics import read_metrics


def _cfg(target, out, *extra):
    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=32",
        "data.seq_length=128", "data.batch_size=8", "data.val_fraction=0.25",
        "draft.ttt_steps=2", "draft.draft_vocab_size=128", "optim.lr=3e-3", "optim.warmup_ratio=0.0",
        "train.steps=6", "train.log_every=1", "train.eval_batches=1", "train.eval_every=0",
        "train.progress=false", "checkpoint.every_steps=2", "export.at_end=false",
        "regenerate.every_steps=2", "regenerate.slice_size=16", "regenerate.max_new_tokens=4",
        "regenerate.batch_size=8", "regenerate.max_prompt_tokens=100", *extra,
    ])


def _example(token: int, n: int):
    from specjax.data.chat import Example

    return Example(np.full(n, token, np.int32), np.ones(n, np.int32))


def _stream(examples, load_round=None):
    from specjax.data import make_train_iterator
    from specjax.train.regen_rounds import RegenPool, RegenStream

    pool = RegenPool()
    stream = RegenStream(make_train_iterator(examples, 16, 8, 0, pool=pool), pool)
    stream.load_round = load_round
    return stream


def test_a_round_enters_the_stream_and_the_stream_resumes_exactly():
    examples = [_example(1 + i, 5 + i % 4) for i in range(20)]
    new = {i: _example(100 + i, 3 + i % 5) for i in range(20)}
    stream = _stream(examples)
    for _ in range(2):
        next(stream)
    stream.pool.apply(1, new)
    saved = stream.get_state()  # right after the round: the packer's open rows hold old examples
    after = [next(stream) for _ in range(6)]
    tokens = [set(np.unique(b["input_ids"]).tolist()) - {0} for b in after]
    assert tokens[0] & set(range(100, 120)), "the round's examples are in the next batch"
    assert all(t <= set(range(100, 120)) for t in tokens[2:]), tokens  # no old version once the open rows are out
    later = stream.get_state()
    more = [next(stream) for _ in range(3)]

    for state, want in ((saved, after + more), (later, more)):
        again = _stream(examples, load_round=lambda r: new)
        again.set_state(state)
        assert again.pool.rounds == [{"round": 1, "from": stream.pool.rounds[0]["from"], "replaced": 20}]
        for w in want:
            got = next(again)
            for k in w:
                np.testing.assert_array_equal(got[k], w[k])


def test_rounds_train_are_logged_and_a_resumed_run_matches(tiny_target, tmp_path):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from specjax.data.datasets import read_conversations
    from specjax.regen.common import prompt_messages
    from specjax.train.loop import train
    from specjax.train.regen_rounds import prompt_key
    from specjax.train.run import prepare_training_examples
    from specjax.train.setup import resolve_path

    full, split = tmp_path / "full", tmp_path / "split"
    res = train(_cfg(tiny_target, full))
    assert res.final_step == 6
    rounds = read_metrics(str(full), "regen")
    assert [r["step"] for r in rounds] == [2, 4] and [r["round"] for r in rounds] == [1, 2]
    assert all(r["prompts"] == 16 and r["tokens_generated"] > 0 and 0 < r["replaced"] <= r["answered"] <= 16
               and r["wall_s"] > 0 for r in rounds), rounds
    a = {r["step"]: r for r in read_metrics(str(full), "train")}
    assert [a[s]["regen_rounds"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert a[6]["regen_examples"] == rounds[0]["replaced"] + rounds[1]["replaced"]

    # killed after round 2 wrote its answers, before the checkpoint at step 4: resumes at step 2 (round 1
    # applied, the stream mid-way), redoes round 2 from its shard
    first = train(_cfg(tiny_target, split, "train.stop_at_step=5"))
    assert first.stopped_early and first.final_step == 5
    for step in ("4", "5"):
        shutil.rmtree(split / "checkpoints" / step)
    assert train(_cfg(tiny_target, split)).start_step == 2
    b = {r["step"]: r for r in read_metrics(str(split), "train")}
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        for key in ("loss", "acc_0", "grad_norm", "regen_rounds", "regen_examples"):
            np.testing.assert_allclose(b[step][key], a[step][key], rtol=1e-6, atol=1e-7, err_msg=f"{key} @ {step}")
    assert [(r["round"], r["reused_shard"]) for r in read_metrics(str(split), "regen")] == [(1, 0), (2, 0), (2, 1)]

    # the held-out rows' prompts are never answered into training
    cfg = _cfg(tiny_target, tmp_path / "prep")
    (tmp_path / "prep").mkdir()
    prep = prepare_training_examples(cfg, AutoTokenizer.from_pretrained(tiny_target), str(tmp_path / "prep"))
    val_rows = {(ex.source, ex.row) for ex in prep.val}
    assert val_rows and prep.train
    val_keys = {prompt_key(prompt_messages(r.messages))
                for r in read_conversations([resolve_path(p) for p in cfg.data.train_files])
                if (str(r.source), r.index + 1) in val_rows}
    shards = sorted((full / "regen_rounds").glob("shard-*.parquet"))
    assert [s.name for s in shards] == ["shard-000001.parquet", "shard-000002.parquet"]
    answered = [m for s in shards for m in pq.read_table(s).to_pydict()["messages"]]
    assert len(answered) == sum(r["replaced"] for r in rounds)
    for messages in answered:
        assert messages[-1]["role"] == "assistant"
        assert prompt_key(messages) not in val_keys
        assert not any(set(prompt_key(messages)) >= set(k) for k in val_keys)
    # the rounds went round the training prompts: 32 answers over fewer prompts
    assert len({tuple(prompt_key(m)) for m in answered}) < len(answered) <= 2 * 16


def test_settings_that_cannot_work_are_refused(tiny_target, tmp_path):
    from specjax.train.loop import train

    cases = [
        (("regenerate.slice_size=0",), r"slice_size=0.*Fix: set regenerate.slice_size >= 1"),
        (("target.source=cache", f"target.cache_dir={tmp_path / 'c'}"),
         r"target.source=cache.*Fix: target.source=online, or regenerate.every_steps=0"),
        (("regenerate.backend=openai",), r"needs regenerate.endpoint and regenerate.model"),
        (("regenerate.turns=all", "regenerate.long_prompts=drop_oldest_turns"),
         r"several rows per conversation. Fix: regenerate.long_prompts=skip"),
        (("regenerate.every_steps=6",), r"every_steps=6 >= train.steps=6.*Fix: regenerate.every_steps < 6"),
    ]
    for i, (extra, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            train(_cfg(tiny_target, tmp_path / f"r{i}", *extra))
    assert not os.path.exists(tmp_path / "r0" / "regen_rounds")



def test_regeneration_turned_off_on_resume_keeps_the_rounds_examples(tiny_target, tmp_path):
    """A run stopped at step 3 (round 1 applied at step 2) resumed with regenerate.every_steps=0 and
    checkpoint.allow_config_change: it used to fail inside grain (the regeneration state handed to a plain
    grain iterator: KeyError 'parent') and set every checkpoint aside as damaged. Now it resumes at step 3
    with round 1's examples in the stream and runs no new round: its step 4 equals the uninterrupted
    regenerating run's step 4 (round 2 only takes effect from step 5; loss, acc_0, grad_norm to 1e-6),
    and a second stop/resume with regeneration off continues it exactly (steps 5-6, 1e-6). With round 1's
    shard gone, the resume stops before training with an error naming the shard and the fix, and the
    checkpoints stay in place."""
    from specjax.train.loop import train
    from specjax.train.regen_rounds import RegenShardMissing

    full = tmp_path / "full"
    train(_cfg(tiny_target, full))
    a = {r["step"]: r for r in read_metrics(str(full), "train")}

    off = ("regenerate.every_steps=0", "checkpoint.allow_config_change=true")
    run, again = tmp_path / "run", tmp_path / "again"
    assert train(_cfg(tiny_target, run, "train.stop_at_step=3")).final_step == 3
    shutil.copytree(run, again)
    res = train(_cfg(tiny_target, run, *off, "train.stop_at_step=5"))
    assert res.start_step == 3 and res.final_step == 5
    assert not [p.name for p in (run / "checkpoints").iterdir() if "damaged" in p.name]
    b = {r["step"]: r for r in read_metrics(str(run), "train")}
    for key in ("loss", "acc_0", "grad_norm"):
        np.testing.assert_allclose(b[4][key], a[4][key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert [r["round"] for r in read_metrics(str(run), "regen")] == [1]  # no round after regeneration went off
    assert sorted(p.name for p in (run / "regen_rounds").glob("shard-*.parquet")) == ["shard-000001.parquet"]
    # the checkpoints written with regeneration off still hold round 1: stop at 5, resume to 6
    assert train(_cfg(tiny_target, run, *off)).start_step == 5
    assert train(_cfg(tiny_target, again, *off)).start_step == 3  # the same stretch without the stop at 5
    b = {r["step"]: r for r in read_metrics(str(run), "train")}
    c = {r["step"]: r for r in read_metrics(str(again), "train")}
    for step in (4, 5, 6):
        for key in ("loss", "acc_0", "grad_norm"):
            np.testing.assert_allclose(b[step][key], c[step][key], rtol=1e-6, atol=1e-7, err_msg=f"{key} @ {step}")
    assert b[5]["loss"] != a[5]["loss"]  # round 2 is in the regenerating run's step 5, not in this one's

    gone = tmp_path / "gone"
    shutil.copytree(tmp_path / "again", gone, ignore=shutil.ignore_patterns("regen_rounds"))
    with pytest.raises(RegenShardMissing, match=r"regeneration round 1, whose answers .*shard-000001.parquet are "
                                                r"gone. Fix: restore"):
        train(_cfg(tiny_target, gone, *off))
    assert not [p.name for p in (gone / "checkpoints").iterdir() if "damaged" in p.name]

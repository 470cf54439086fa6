"""Regeneration with the in-process JAX back end on the tiny target: shards + manifest, resume
skips finished shards, a changed setting is refused by name, a leftover temporary shard is
ignored, the output reads back as training data, and the config / launch stage."""
from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest

import specjax.eval.generate as gen_mod
from specjax.config import config_from_dict
from specjax.data import prepare_examples, read_conversations
from specjax.regen.common import ManifestMismatch, RegenerateError, prompt_messages, split_reasoning
from specjax.regenerate import regenerate, run_from_config

SETTINGS = dict(backend="jax", max_new_tokens=8, batch_size=4, shard_size=4, max_prompt_tokens=100,
                dtype="float32")


def conv(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("regen_src")
    rows = [json.dumps(conv(("user", f"Please compute {i} plus {i + 3}."), ("assistant", "old"))) for i in range(5)]
    rows[1] = json.dumps(conv(("system", "You are a helpful assistant."), ("user", "When was Oldmere founded?"),
                              ("assistant", "Oldmere was founded in 1102."), ("user", "And Korvath?"),
                              ("assistant", "old"), ("assistant", "older")))  # two trailing turns dropped
    rows.insert(3, json.dumps(conv(("system", "no question here"))))  # nothing to answer
    rows.insert(4, "{not json")
    rows.append(json.dumps(conv(("user", "Spell the word garden. " * 12), ("assistant", "x"))))  # > 100 tokens
    rows += [json.dumps(conv(("user", f"Spell the word {w} letter by letter."))) for w in ("apple", "river")]
    p = d / "chats.jsonl"
    p.write_text("\n".join(rows) + "\n")
    return str(p)


class Counting:
    """Wraps specjax.eval.generate.generate, counting calls and prompts."""

    def __init__(self, fn=gen_mod.generate):
        self.fn = fn
        self.calls = 0
        self.prompts = 0

    def __call__(self, target, prompts, **kw):
        self.calls += 1
        self.prompts += len(prompts)
        return self.fn(target, prompts, **kw)


def shard_rows(d):
    names = sorted(n for n in os.listdir(d) if n.endswith(".parquet"))
    return {n: pq.read_table(os.path.join(d, n)).to_pylist() for n in names}


def test_prompt_and_reasoning_helpers():
    m = conv(("system", "s"), ("user", "u"), ("assistant", "a"), ("user", "u2"), ("assistant", "b"))["messages"]
    assert prompt_messages(m) == m[:4]
    assert prompt_messages(conv(("system", "s"))["messages"]) is None
    assert prompt_messages(conv(("assistant", "a"))["messages"]) is None
    assert split_reasoning("<think>\nhm\n</think>\n\nYes.") == ("hm", "Yes.")
    assert split_reasoning("hm\n</think>\nYes.") == ("hm", "Yes.")  # the prompt opened the block
    assert split_reasoning("Yes.", "hm ") == ("hm", "Yes.")  # reasoning_content field
    assert split_reasoning("<think>never closed") == ("never closed", "")
    assert split_reasoning("plain") == (None, "plain")


def test_regenerate_resume_and_refusals(tiny_target, source, tmp_path):
    out = str(tmp_path / "regen")
    count = Counting()
    s = regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, **SETTINGS)
    # 10 rows read: 1 malformed, 1 without a user turn -> 8 conversations -> shards of 4, 4
    assert (s.rows_in, s.conversations, s.shards_written) == (10, 8, 2)
    assert s.skipped == {"malformed JSON": 1, "no user turn to answer": 1,
                         "prompt longer than max_prompt_tokens": 1}, s.skipped
    assert s.written + sum(v for k, v in s.skipped.items() if k in ("empty answer",)) == 7
    # an injected generate answers every shard's waiting prompts in one call per round (one round here)
    assert count.calls == 1 and count.prompts == 7
    assert 0 < s.tokens_generated <= 7 * 8
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-000000.parquet", "shard-000001.parquet"]

    man = json.load(open(os.path.join(out, "manifest.json")))
    assert man["input"] == os.path.abspath(source) and man["model"] == os.path.abspath(tiny_target)
    assert (man["backend"], man["temperature"], man["top_p"], man["max_new_tokens"], man["shard_size"]) == \
        ("jax", 0.0, 1.0, 8, 4)
    assert man["specjax_version"] and man["limit"] is None

    first = shard_rows(out)
    rows = [r for n in sorted(first) for r in first[n]]
    assert [r["source_index"] for r in rows] == [0, 1, 2, 5, 6, 8, 9][: len(rows)]
    multi = next(r for r in rows if r["source_index"] == 1)["messages"]
    # context (system, user, intermediate assistant, user) kept; both trailing turns replaced
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert multi[2]["content"] == "Oldmere was founded in 1102." and multi[-1]["content"] not in ("old", "older")
    # the new answer is the target's greedy continuation of the rendered prompt
    from transformers import AutoTokenizer

    from specjax.targets import load_target

    tok = AutoTokenizer.from_pretrained(tiny_target)
    target = load_target(tiny_target, dtype="float32")
    ids = tok(tok.apply_chat_template(multi[:-1], tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    eos = [tok.eos_token_id] + json.load(open(os.path.join(tiny_target, "generation_config.json")))["eos_token_id"]
    new = gen_mod.generate(target, [ids], max_new_tokens=8, eos_token_ids=eos)[0]
    assert multi[-1]["content"] == split_reasoning(tok.decode(new, skip_special_tokens=True))[1]

    # --- rerun without --resume: refused
    with pytest.raises(RegenerateError, match="--resume"):
        regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, **SETTINGS)
    # --- resume with a different setting: refused, naming the key and both values
    with pytest.raises(ManifestMismatch, match=r"max_new_tokens: 8 .* != 16 now") as e:
        regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, resume=True,
                   **{**SETTINGS, "max_new_tokens": 16})
    assert "shard_size" not in str(e.value)
    with pytest.raises(ManifestMismatch, match="temperature"):
        regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, resume=True,
                   temperature=0.7, **SETTINGS)
    assert count.calls == 1  # refusals happen before any generation

    # --- resume after a kill during the second shard: its temporary file is ignored
    os.remove(os.path.join(out, "shard-000001.parquet"))
    with open(os.path.join(out, "shard-000001.parquet.x1y2.tmp"), "wb") as f:
        f.write(b"PAR1 half-written")
    # a reader of the folder meanwhile sees the finished shard only
    assert [r.error for r in read_conversations(out)] == [None] * len(first["shard-000000.parquet"])
    s2 = regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, resume=True, **SETTINGS)
    assert (count.calls, count.prompts) == (2, 10)  # only the missing shard's 3 prompts were generated
    assert (s2.shards_resumed, s2.shards_written) == (1, 1)
    assert s2.written == s.written and s2.skipped == s.skipped
    assert shard_rows(out) == first  # greedy answers do not depend on batching: same output
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]  # the leftover was cleaned up

    # --- a finished run resumes to nothing
    s3 = regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, resume=True, **SETTINGS)
    assert count.calls == 2 and s3.shards_resumed == 2 and s3.written == s.written

    # --- the output trains: it reads back as conversations and tokenizes with loss masks
    back = list(read_conversations(out))  # the folder, as data.train_files gives it
    assert all(r.error is None for r in back) and len(back) == s.written
    assert [r.messages for r in back] == [r["messages"] for r in rows]
    prep = prepare_examples([out], tok, 256, 0.0, 0)
    assert len(prep.train) + sum(prep.skipped.values()) == s.written and prep.train
    assert all(int(e.loss_mask.sum()) > 0 for e in prep.train)


def test_input_errors(tiny_target, tmp_path):
    with pytest.raises(RegenerateError, match="input not found"):
        regenerate(input=str(tmp_path / "nope.jsonl"), out_dir=str(tmp_path / "o"), target=tiny_target)
    with pytest.raises(RegenerateError, match="needs the target folder"):
        regenerate(input=__file__, out_dir=str(tmp_path / "o"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps(conv(("user", "hi"))) + "\n")
    with pytest.raises(RegenerateError, match="not empty and holds no manifest.json"):
        regenerate(input=str(p), out_dir=str(tmp_path / "busy"), target=tiny_target)


def test_run_from_config_and_launch_stage(tiny_target, source, tmp_path, monkeypatch):
    from specjax.train.run import run_regenerate_stage

    import specjax.eval.continuous as cont

    class Runs:  # counts the continuous batch's runs (the back end's engine when nothing is injected)
        calls = 0

        def __init__(self, run=cont.ContinuousGenerator.run):
            self.run = run

        def __get__(self, obj, cls):
            def run(*a, **kw):
                Runs.calls += 1
                return self.run(obj, *a, **kw)
            return run

    calls = Runs
    monkeypatch.setattr(cont.ContinuousGenerator, "run", Runs())
    cfg_dict = {
        "run": {"output_dir": str(tmp_path / "run")},
        "target": {"path": tiny_target, "dtype": "float32"},
        "regenerate": {"enabled": True, "source": source, "limit": 4, "shard_size": 4, "batch_size": 4,
                       "max_new_tokens": 8, "max_prompt_tokens": 100},
    }
    cfg = config_from_dict(cfg_dict)
    out = run_from_config(cfg)
    assert out == os.path.abspath(tmp_path / "run" / "regenerated") and calls.calls == 1
    assert os.listdir(out) and "shard-000000.parquet" in os.listdir(out)
    # the launch stage resumes (nothing left to do) and points training at the output
    cfg2 = run_regenerate_stage(cfg)
    assert calls.calls == 1 and cfg2.data.train_files == (out,)
    assert run_regenerate_stage(config_from_dict({})) == config_from_dict({})  # disabled: unchanged
    # training files that do not list the regeneration's output: refused before any regeneration
    other = config_from_dict({**cfg_dict, "regenerate": {**cfg_dict["regenerate"], "out_dir": str(tmp_path / "r2")},
                              "data": {"train_files": [out]}})
    with pytest.raises(ValueError, match="does not list, so training would not use it"):
        run_regenerate_stage(other)
    assert calls.calls == 1 and not os.path.exists(tmp_path / "r2")
    shutil.rmtree(out)


def test_presets_as_input(monkeypatch):
    """`preset://NAME` (or the bare name) goes through specjax.data.presets; evaluation presets are
    refused. Uses a stand-in module when the presets module is not installed."""
    import sys
    import types

    import specjax.data
    from specjax.data.sources import Row
    from specjax.regen.inputs import canonical_input, iter_rows

    try:
        from specjax.data import presets  # noqa: F401
    except ImportError:
        fake = types.ModuleType("specjax.data.presets")
        fake.PRESETS, fake.EVAL_PRESETS = ("sharegpt", "mtbench", "humaneval"), ("mtbench", "humaneval")
        fake.preset_rows = lambda name, limit=None: iter(
            [Row(name, 0, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], None)])
        monkeypatch.setitem(sys.modules, "specjax.data.presets", fake)
        monkeypatch.setattr(specjax.data, "presets", fake, raising=False)
    assert canonical_input("sharegpt") == canonical_input("preset://sharegpt") == "preset://sharegpt"
    first = next(iter_rows("preset://sharegpt"))
    assert first.error is None and prompt_messages(first.messages)[-1]["role"] == "user"
    for name in ("mtbench", "preset://humaneval"):
        with pytest.raises(RegenerateError, match="evaluation set"):
            canonical_input(name)
    with pytest.raises(RegenerateError, match="unknown dataset preset 'nope'"):
        canonical_input("preset://nope")


def test_long_prompts_drop_oldest_turns(tiny_target, tmp_path):
    """long_prompts=drop_oldest_turns drops whole exchanges from the start (a leading system message
    stays) until the prompt fits; the written row holds the turns actually sent; a prompt whose last
    user turn alone is too long is still skipped; the setting is a compared manifest key, and a
    manifest written before it existed resumes as "skip"."""
    from transformers import AutoTokenizer

    from specjax.regen.common import Item
    from specjax.regen.jax_backend import JaxBackend

    tok = AutoTokenizer.from_pretrained(tiny_target)
    long_turn = "Tell me everything about rivers and lakes. " * 6
    full = conv(("system", "Be brief."), ("user", long_turn), ("assistant", long_turn),
                ("user", "Name a river."), ("assistant", "The Nile."), ("user", "And a lake?"))["messages"]
    kept = [full[0]] + full[3:]  # system + the last exchange + the turn to answer

    def backend(limit, mode):
        return JaxBackend(None, tok, chat_template=None, eos_ids=[tok.eos_token_id], max_new_tokens=4,
                          temperature=0.0, top_p=1.0, max_prompt_tokens=limit, batch_size=2, seed=0,
                          keep_reasoning=True, long_prompts=mode,
                          generate_fn=lambda target, prompts, **kw: [[ord("x")] * 3 for _ in prompts])

    n_full, n_kept = len(backend(10_000, "skip").encode(full)), len(backend(10_000, "skip").encode(kept))
    assert n_kept < n_full
    assert backend(n_kept, "skip").fit_prompt(full) is None
    ids, used = backend(n_kept, "drop_oldest_turns").fit_prompt(full)
    assert used == tuple(kept) and len(ids) == n_kept
    assert backend(n_full, "drop_oldest_turns").fit_prompt(full)[1] is None  # fits: nothing dropped
    last = [full[0], full[-1]]  # a tighter limit drops the next exchange too
    n_last = len(backend(10_000, "skip").encode(last))
    assert backend(n_kept - 1, "drop_oldest_turns").fit_prompt(full)[1] == tuple(last)
    assert backend(n_last - 1, "drop_oldest_turns").fit_prompt(full) is None  # the last turn is never cut
    ans = backend(n_kept, "drop_oldest_turns").answer([Item(0, tuple(full))])[0]
    assert ans.content and ans.prompt == tuple(kept)
    with pytest.raises(RegenerateError, match="long_prompts"):
        backend(n_kept, "truncate")

    # through the stage: the row is the shortened prompt + the new answer
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"messages": full + [{"role": "assistant", "content": "old"}]}) + "\n")
    out = str(tmp_path / "regen")
    settings = {**SETTINGS, "max_prompt_tokens": n_kept, "long_prompts": "drop_oldest_turns"}
    s = regenerate(input=str(src), out_dir=out, target=tiny_target, **settings)
    assert (s.written, s.shortened, s.skipped) == (1, 1, {})
    row = shard_rows(out)["shard-000000.parquet"][0]["messages"]
    assert row[:-1] == kept and row[-1]["role"] == "assistant" and row[-1]["content"] != "old"
    assert json.load(open(os.path.join(out, "manifest.json")))["long_prompts"] == "drop_oldest_turns"
    with pytest.raises(ManifestMismatch, match='long_prompts: "drop_oldest_turns" .* != "skip" now'):
        regenerate(input=str(src), out_dir=out, target=tiny_target, resume=True,
                   **{**settings, "long_prompts": "skip"})

    # turns="all": answering "Name a river." needs the long first exchange dropped, so the conversation
    # so far is written first as a window of its own; the final row continues from the shortened prompt.
    # A resume reads the windows, truncated and shortened counts back from the shards.
    three = lambda target, prompts, **kw: [[ord("x")] * 3 for _ in prompts]  # noqa: E731
    xxx = tok.decode([ord("x")] * 3)
    first = [full[0], full[1]]
    limit = len(backend(10_000, "skip").encode(first))  # round 1 fits exactly; round 2 does not
    assert len(backend(10_000, "skip").encode(first + [{"role": "assistant", "content": xxx}, full[3]])) > limit
    out_all = str(tmp_path / "regen_all")
    settings_all = {**SETTINGS, "max_prompt_tokens": limit, "long_prompts": "drop_oldest_turns", "turns": "all",
                    "max_new_tokens": 3}
    s = regenerate(input=str(src), out_dir=out_all, target=tiny_target, generate_fn=three, **settings_all)
    rows = [r["messages"] for r in shard_rows(out_all)["shard-000000.parquet"]]
    answer = {"role": "assistant", "content": xxx}
    assert rows == [first + [answer], [full[0], full[3], answer, full[5], answer]]
    assert (s.written, s.windows, s.turns_answered, s.shortened, s.truncated) == (2, 1, 3, 1, 3)
    again = regenerate(input=str(src), out_dir=out_all, target=tiny_target, generate_fn=three, resume=True,
                       **settings_all)
    assert (again.written, again.windows, again.turns_answered, again.shortened, again.truncated,
            again.tokens_generated) == (2, 1, 3, 1, 3, 0)

    # a manifest from before the key existed resumes under the default ("skip") and no other
    old = str(tmp_path / "old")
    regenerate(input=str(src), out_dir=old, target=tiny_target, **{**SETTINGS, "max_prompt_tokens": n_kept})
    path = os.path.join(old, "manifest.json")
    man = json.load(open(path))
    del man["long_prompts"]
    open(path, "w").write(json.dumps(man))
    assert regenerate(input=str(src), out_dir=old, target=tiny_target, resume=True,
                      **{**SETTINGS, "max_prompt_tokens": n_kept}).shards_resumed == 1
    with pytest.raises(ManifestMismatch, match="long_prompts"):
        regenerate(input=str(src), out_dir=old, target=tiny_target, resume=True,
                   **{**SETTINGS, "max_prompt_tokens": n_kept, "long_prompts": "drop_oldest_turns"})


def test_answer_every_turn_rounds_and_cuts():
    """turns="all": each round sends the conversation so far with the target's OWN earlier answers
    (never the source's), batched across conversations; a failed first turn skips the conversation,
    a failed later turn ends it there (cut), and a shortened prompt is what the conversation
    continues from."""
    from specjax.regen.common import Answer, Item, answer_every_turn, answer_rounds

    src = conv(("system", "S"), ("assistant", "stray"), ("user", "u1"), ("assistant", "a1"), ("user", "u2a"),
               ("user", "u2b"), ("assistant", "a2"), ("user", "u3"))["messages"]
    rounds = answer_rounds(prompt_messages(src))
    assert [[m["content"] for m in r] for r in rounds] == [["S", "u1"], ["u2a", "u2b"], ["u3"]]

    calls = []

    def answer(items):
        calls.append([it.prompt for it in items])
        out = []
        for it in items:
            last = it.prompt[-1]["content"]
            if last == "fail-first" or last == "fail-later":
                out.append(Answer(None, "prompt longer than max_prompt_tokens", 0))
            elif last == "shorten":
                out.append(Answer("ok", None, 2, prompt=(it.prompt[-1],)))  # older turns dropped
            else:
                out.append(Answer(f"T({last})", None, 3, truncated=last == "u2b"))
        return out

    items = [Item(0, tuple(prompt_messages(src))),
             Item(1, tuple(conv(("user", "fail-first"), ("assistant", "x"), ("user", "q"))["messages"])),
             Item(2, tuple(conv(("user", "p1"), ("assistant", "x"), ("user", "fail-later"), ("assistant", "y"),
                                ("user", "never"))["messages"])),
             Item(3, tuple(conv(("user", "p0"), ("assistant", "x"), ("user", "shorten"), ("assistant", "y"),
                                ("user", "after"))["messages"]))]
    convs = answer_every_turn(answer, items)
    assert [len(c) for c in calls] == [4, 3, 2]  # round 0: all four; round 1: 0, 2, 3; round 2: 0, 3
    assert [m["content"] for m in convs[0].messages] == ["S", "u1", "T(u1)", "u2a", "u2b", "T(u2b)", "u3", "T(u3)"]
    assert all(m["content"] not in ("a1", "a2", "stray") for p in calls[1] + calls[2] for m in p)
    assert (convs[0].turns, convs[0].rounds, convs[0].truncated, convs[0].new_tokens) == (3, 3, 1, 9)
    assert convs[1].messages is None and convs[1].skip_reason == "prompt longer than max_prompt_tokens"
    assert [m["content"] for m in convs[2].messages] == ["p1", "T(p1)"]
    assert (convs[2].turns, convs[2].cut_reason) == (1, "prompt longer than max_prompt_tokens")
    assert [m["content"] for m in convs[3].messages] == ["shorten", "ok", "after", "T(after)"]
    assert convs[3].shortened and convs[3].turns == 3 and convs[3].cut_reason is None
    # what the conversation held before the prompt was shortened is a finished window: no answer is lost
    assert [[m["content"] for m in w] for w in convs[3].windows] == [["p0", "T(p0)"]]
    assert convs[3].rows() == [convs[3].windows[0], convs[3].messages]
    assert convs[0].windows == [] and convs[1].rows() == []


def test_regenerate_every_turn_through_the_stage(tiny_target, source, tmp_path):
    """The stage with turns="all": the two-turn conversation gets two new answers and none of the
    source's; turns and rows are counted; the manifest records the mode, so resuming with "last"
    is refused; a resume with the same mode reads everything back without generating."""
    count = Counting()
    out = str(tmp_path / "all")
    s = regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, turns="all", **SETTINGS)
    rows = [r for rs in shard_rows(out).values() for r in rs]
    two = next(r for r in rows if r["source_index"] == 1)["messages"]
    assert [m["role"] for m in two] == ["system", "user", "assistant", "user", "assistant"]
    assert [two[1]["content"], two[3]["content"]] == ["When was Oldmere founded?", "And Korvath?"]
    assert not {"Oldmere was founded in 1102.", "old", "older"} & {m["content"] for m in two}
    assert s.turns_answered == sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows) == s.written + 1
    assert count.calls == 2  # round 0: both shards' first turns; round 1: the two-turn conversation's second
    # the continuous batch (no injected generate: the back end's own engine, 3 rows refilled as answers
    # end) writes the same shards: greedy answers do not depend on batching or on turn scheduling
    cont = str(tmp_path / "continuous")
    s_cont = regenerate(input=source, out_dir=cont, target=tiny_target, turns="all", **{**SETTINGS, "batch_size": 3})
    assert shard_rows(cont) == shard_rows(out)
    assert (s_cont.written, s_cont.turns_answered, s_cont.tokens_generated, s_cont.skipped) == \
        (s.written, s.turns_answered, s.tokens_generated, s.skipped)
    assert json.load(open(os.path.join(out, "manifest.json")))["turns"] == "all"
    with pytest.raises(ManifestMismatch, match="turns"):
        regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, resume=True, **SETTINGS)
    again = regenerate(input=source, out_dir=out, target=tiny_target, generate_fn=count, resume=True, turns="all",
                       **SETTINGS)
    assert (again.written, again.turns_answered, again.tokens_generated, count.calls) == (s.written, s.turns_answered, 0, 2)
    with pytest.raises(RegenerateError, match="turns must be"):
        regenerate(input=source, out_dir=str(tmp_path / "x"), target=tiny_target, turns="every", **SETTINGS)
    # a directory written before the option existed (no "turns" in its manifest) resumes as "last"
    old = str(tmp_path / "old")
    regenerate(input=source, out_dir=old, target=tiny_target, generate_fn=count, **SETTINGS)
    path = os.path.join(old, "manifest.json")
    m = json.load(open(path))
    del m["turns"]
    json.dump(m, open(path, "w"))
    assert regenerate(input=source, out_dir=old, target=tiny_target, generate_fn=count, resume=True,
                      **SETTINGS).tokens_generated == 0
    with pytest.raises(ManifestMismatch, match="turns"):
        regenerate(input=source, out_dir=old, target=tiny_target, resume=True, turns="all", **SETTINGS)

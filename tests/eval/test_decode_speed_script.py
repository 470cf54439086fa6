"""benchmarks/decode_speed.py on the tiny target in fp32 under `highest`, where speculative decoding
must equal greedy: with --turns 2 each batch size has a row per turn and one for both, the second
turns' prompts hold the first turns' greedy answers, and the "1+2" row is the sum of the two."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import decode_speed  # noqa: E402


def test_two_turns_rows_and_lossless(tiny_target, tmp_path):
    out = tmp_path / "speed.json"
    rc = decode_speed.main(["--target", tiny_target, "--prompts", "mtbench", "--limit", "2", "--batch", "2",
                            "--k", "3", "--max-new-tokens", "6", "--dtype", "float32", "--matmul-precision", "highest",
                            "--repeats", "1", "--turns", "2", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["turn"] for r in rows] == [1, 2, "1+2"]
    one, two, both = rows
    # fp32 under `highest`: every turn of every prompt equals greedy
    assert one["rows_equal_greedy"] == 2 and two["rows_equal_greedy"] == 2 and both["rows_equal_greedy"] == 4
    for key in ("greedy_tokens", "spec_tokens", "spec_steps"):
        assert both[key] == one[key] + two[key], key
    assert both["accepted_per_position"] == [x + y for x, y in zip(one["accepted_per_position"],
                                                                   two["accepted_per_position"])]
    assert both["spec_walls_s"][0] == pytest.approx(one["spec_walls_s"][0] + two["spec_walls_s"][0])
    assert both["speedup"] == pytest.approx(both["spec_tok_s"] / both["greedy_tok_s"])
    assert both["tau"] == pytest.approx(1 + sum(both["accepted_per_position"]) / both["spec_steps"])
    for key in ("greedy_loop_steps", "spec_loop_steps"):
        assert both[key] == one[key] + two[key], key
    for r in rows:  # one batch of 2 rows a turn: the loop runs as long as its longer row
        assert r["batch_rows"] == 2
        assert r["spec_steps"] / 2 <= r["spec_loop_steps"] <= r["spec_steps"]
        assert r["greedy_tokens"] / 2 <= r["greedy_loop_steps"] <= r["greedy_tokens"]
        assert r["spec_idle_row_steps"] == pytest.approx(1 - r["spec_steps"] / (2 * r["spec_loop_steps"]))
        assert r["spec_tokens_per_loop_step"] == pytest.approx(r["spec_tokens"] / r["spec_loop_steps"])


def test_first_turn_loop_steps_equal_the_per_prompt_decoders(tiny_target, tmp_path):
    """The loop counts of a batch of 2 against each prompt decoded alone: the host-driven SpecDecoder's
    steps and `generate`'s tokens, the longer row of each setting the batch's iterations."""
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, random_draft
    from specjax.targets import load_target

    out = tmp_path / "speed.json"
    assert decode_speed.main(["--target", tiny_target, "--prompts", "mtbench", "--limit", "2", "--batch", "2",
                              "--k", "3", "--max-new-tokens", "6", "--dtype", "float32", "--matmul-precision",
                              "highest", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert res["settings"]["draft_dtype"] == "float32"  # the default "auto", resolved for an fp32 target
    prompts, eos, _ = decode_speed._prompts(tiny_target, "mtbench", 2)
    target = load_target(tiny_target, dtype="float32")
    dec = SpecDecoder(target, random_draft(target), num_spec_tokens=3, matmul_precision="highest")
    steps = [dec.generate(p, max_new_tokens=6, eos_token_ids=eos).num_steps for p in prompts]
    with dec.matmul_precision_context():
        tokens = [len(generate(target, [p], max_new_tokens=6, eos_token_ids=eos)[0]) for p in prompts]
    assert (row["spec_loop_steps"], row["greedy_loop_steps"]) == (max(steps), max(tokens))
    assert row["spec_steps"] == sum(steps) and row["greedy_tokens"] == sum(tokens)


def test_loop_steps_are_each_static_batch_longest_row():
    assert decode_speed._loop_steps([3, 5, 2, 2, 7], 2) == 5 + 2 + 7
    assert decode_speed._loop_steps([4, 1, 6], 1) == 11


def test_second_turn_prompts_hold_the_first_answers(tiny_target):
    """Each second-turn prompt is the first user turn, then that prompt's own answer, then the second
    user turn, in that order (answers that differ per prompt, so a mix-up or a missing answer fails)."""
    from transformers import AutoTokenizer

    from specjax.data.datasets import load_eval_prompts

    tok = AutoTokenizer.from_pretrained(tiny_target)
    _, _, second_turns = decode_speed._prompts(tiny_target, "mtbench", 2)
    texts = ["one red fox", "two blue hats"]
    answers = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    evals = load_eval_prompts("mtbench", limit=2)
    for p, own, other, second in zip(evals, texts, texts[::-1], second_turns(answers)):
        text = tok.decode(second)
        at_user1, at_answer, at_user2 = text.find(p.turns[0]), text.find(own), text.find(p.turns[1])
        assert -1 < at_user1 < at_answer < at_user2, (at_user1, at_answer, at_user2, text)
        assert other not in text


def test_two_turns_need_real_prompts(capsys):
    with pytest.raises(SystemExit) as e:
        decode_speed.main(["--random-target", "configs/targets/smollm2_135m", "--turns", "2"])
    assert e.value.code == 2 and "--turns 2 needs --target" in capsys.readouterr().err


def test_bf16_draft_flag(tiny_target, tmp_path):
    """--draft-dtype bfloat16 reaches the decoder (recorded in the settings) and stays lossless
    against an fp32 target under `highest`."""
    out = tmp_path / "speed.json"
    assert decode_speed.main(["--target", tiny_target, "--prompts", "mtbench", "--limit", "2", "--batch", "2",
                              "--k", "3", "--max-new-tokens", "6", "--dtype", "float32", "--matmul-precision",
                              "highest", "--repeats", "1", "--draft-dtype", "bfloat16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["draft_dtype"] == "bfloat16"
    assert res["rows"][0]["rows_equal_greedy"] == 2
    # the XLA options the run compiled under are part of its record (conftest sets some)
    assert res["machine"]["xla_flags"] == os.environ["XLA_FLAGS"] != ""


def test_refill_both_arms_in_device(tiny_target, tmp_path):
    """--refill: both arms stream the prompts through the rows inside one device loop (greedy
    generate(refill=True), speculative SpecLoop refill=True); 3 prompts through 2 rows, so a row is
    refilled, and every answer still equals greedy (fp32, `highest`)."""
    out = tmp_path / "speed.json"
    assert decode_speed.main(["--target", tiny_target, "--prompts", "mtbench", "--limit", "4", "--batch", "2",
                              "--k", "3", "--max-new-tokens", "6", "--dtype", "float32", "--matmul-precision",
                              "highest", "--repeats", "1", "--refill", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["prompts"] == 4 and row["rows_equal_greedy"] == 4
    assert row["greedy_tokens"] == row["spec_tokens"] > 0


def test_decode_attention_flag_reaches_both_arms(tmp_path, repo_root):
    """--decode-attention pallas_gpu_split runs the split kernel (interpret mode here) in cached decoding,
    and the speculative output still equals greedy (fp32 under `highest`)."""
    from specjax_kernels.selection import recording_choices

    out = tmp_path / "speed.json"
    with recording_choices() as chosen:
        assert decode_speed.main([
            "--random-target", os.path.join(repo_root, "configs/targets/smollm2_135m"), "--layers", "3",
            "--prompt-len", "8", "--limit", "2", "--batch", "2", "--k", "2", "--max-new-tokens", "4",
            "--dtype", "float32", "--matmul-precision", "highest", "--repeats", "1",
            "--decode-attention", "pallas_gpu_split", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["decode_attention"] == "pallas_gpu_split"
    assert "pallas_gpu_split" in chosen["decode_attention"]
    assert res["rows"][0]["rows_equal_greedy"] == 2

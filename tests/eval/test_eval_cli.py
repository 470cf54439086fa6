"""`python -m specjax.eval` end to end on the tiny target: a random-init draft exported to a head
folder, MT-bench (2 prompts, two turns each: turn 2 follows the model's own answer) plus a small
JSONL prompt file; the JSON record, the lossless check (0 mismatches at temperature 0) and a
--compare TOST verdict against a saved run."""
import json

import jax
import numpy as np
import pytest

from specjax.eval import stats
from specjax.eval.cli import main
from specjax.eval.report import compare_runs, summarize

K = 3


@pytest.fixture(scope="module")
def draft_dir(tiny_target, tmp_path_factory):
    from specjax.drafts import eagle3
    from specjax.drafts.vocab import DraftVocab
    from specjax.targets import load_target
    from specjax_converters.eagle3_export import export_eagle3

    target = load_target(tiny_target, dtype="float32")
    cfg = eagle3.config_from_target(target.config, draft_vocab_size=128,
                                    aux_layer_ids=target.default_aux_layer_ids())
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(cfg, jax.random.key(0)))
    vocab = DraftVocab.from_ids(np.arange(128), target.config.vocab_size)
    out = tmp_path_factory.mktemp("draft") / "head"
    return export_eagle3(params, cfg, vocab, target.hf_config, str(out), dtype="float32")


@pytest.fixture
def oracle_draft(monkeypatch):
    """Replace the random draft's proposals (through SpecDecoder's test seam) by the target's own
    greedy continuation, wrong at a fixed random 30% of positions, so steps accept 0..K tokens and tau,
    per-position acceptance and their intervals are not degenerate. Verification is unchanged, so
    the output must still equal greedy decoding."""
    import jax.numpy as jnp

    from specjax.eval import spec_decode

    cont = {}
    wrong = np.random.default_rng(0).random(256) < 0.3  # positions the oracle gets wrong

    def override(self, drafts, q, tokens, prompt):
        key = tuple(prompt)
        if key not in cont:
            cont[key] = self.greedy(prompt, max_new_tokens=64, eos_token_ids=()).tokens
        c, n = cont[key], len(tokens)
        props = [c[n + j] if n + j < len(c) and not wrong[(len(prompt) + n + j) % 256] else 0 for j in range(self.k)]
        return jnp.asarray(props, jnp.int32), q

    monkeypatch.setattr(spec_decode.SpecDecoder, "_override_chain", override)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mini.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "Name three colours."}]},
        {"messages": [{"role": "user", "content": "What is two plus two?"},
                      {"role": "assistant", "content": "Four."},
                      {"role": "user", "content": "And times three?"}]},
        {"messages": [{"role": "user", "content": "never reached with --limit 2"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _args(tiny_target, draft_dir, prompt_file, out, *extra):
    return ["--target", tiny_target, "--draft", draft_dir, "--prompts", f"mtbench,{prompt_file}",
            "--limit", "2", "--num-spec-tokens", str(K), "--max-new-tokens", "10", "--out", str(out), *extra]


def test_eval_cli_writes_results_and_compares(tiny_target, draft_dir, prompt_file, oracle_draft, tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(_args(tiny_target, draft_dir, prompt_file, out)) == 0
    printed = capsys.readouterr().out
    assert "tau [95% CI]" in printed and "speedup" in printed and "0 mismatches" in printed

    res = json.loads(out.read_text())  # strict JSON (no NaN)
    assert res["format"] == "specjax-eval" and res["config"]["num_spec_tokens"] == K
    assert res["mismatches"] == 0 and res["equality_checked"] is True
    assert {"jax", "numpy", "python"} <= set(res["versions"]) and res["device"]["platform"] == "cpu"
    assert len(res["datasets"]) == 2 and "mtbench" in res["datasets"]
    mt = res["datasets"]["mtbench"]
    assert mt["n_prompts"] == 2 and mt["n_turns"] == 4  # MT-bench: two turns per question
    other = next(v for k, v in res["datasets"].items() if k != "mtbench")
    assert other["n_prompts"] == 2 and other["n_turns"] == 3  # the second row has two user turns
    for s in res["datasets"].values():
        assert s["tau"]["value"] >= 1.0 and s["steps"] >= 1
        # the oracle is right at ~70% of positions: clearly above 1
        assert 1.3 < s["tau"]["value"] <= K + 1 and s["tau"]["lo"] <= s["tau"]["value"] <= s["tau"]["hi"]
        u = [e["value"] for e in s["acceptance"]["unconditional"]]
        assert all(a >= b for a, b in zip(u, u[1:]))  # accepting i requires accepting i-1
        # tau is vLLM's 1 + accepted/drafts, and the unconditional rates are accepted_i/drafts
        assert s["tau"]["value"] == pytest.approx(1 + sum(u), rel=1e-12)
        assert s["tokens_per_step"]["value"] <= s["tau"]["value"] + 1e-12
        assert len(s["acceptance"]["unconditional"]) == K and len(s["acceptance"]["conditional"]) == K
        assert s["spec_tok_s"]["value"] > 0 and s["greedy_tok_s"]["value"] > 0 and s["speedup"]["value"] > 0
    # the raw per-prompt numbers reproduce the table: tau = 1 + accepted / steps over all turns,
    # tokens_per_step = sum(accept lengths) / steps
    recs = [r for r in res["prompts"] if r["dataset"] == "mtbench"]
    lens = [sum((t["spec"]["accept_lengths"] for t in r["turns"]), []) for r in recs]
    assert mt["tokens_per_step"]["value"] == pytest.approx(stats.tau_estimate(lens).value, rel=1e-12)
    accepted = sum(sum(t["spec"]["accepted_per_position"]) for r in recs for t in r["turns"])
    steps = sum(t["spec"]["num_steps"] for r in recs for t in r["turns"])
    assert mt["accepted"] == accepted and mt["tau"]["value"] == pytest.approx(1 + accepted / steps, rel=1e-12)
    for r in recs:
        assert r["turns"][1]["prompt_tokens"] > r["turns"][0]["prompt_tokens"]  # turn 2 carries turn 1
        for t in r["turns"]:
            assert t["match"] is True
            # the prefill gives the first token; each step emits its accept length (an EOS is
            # counted but not kept, and max_new_tokens may cut the last step)
            assert t["spec"]["new_tokens"] <= 1 + sum(t["spec"]["accept_lengths"])
            assert all(1 <= a <= K + 1 for a in t["spec"]["accept_lengths"])
    again = summarize(res["prompts"], K)
    assert again["mtbench"]["steps"] == mt["steps"]

    # compare with the saved run: the same deterministic tau (diff 0). With 2 prompts per run the
    # 90% interval of the difference is wide (t with ~2 df), so only a loose margin shows equivalence
    out_b = tmp_path / "b.json"
    assert main(_args(tiny_target, draft_dir, prompt_file, out_b, "--compare", str(out), "--margin", "2.5",
                      "--warmup", "0", "--record-tokens")) == 0
    printed = capsys.readouterr().out
    assert "TOST" in printed and printed.count("-> EQUIVALENT") == 2, printed
    res_b = json.loads(out_b.read_text())
    cmp = res_b["comparison"]
    assert cmp["metric"] == "tau" and set(cmp["datasets"]) == set(res["datasets"])
    for d in cmp["datasets"].values():
        assert d["diff"] == pytest.approx(0.0, abs=1e-12) and d["verdict"] == "equivalent"
        assert d["p_low"] < 0.05 and d["p_high"] < 0.05
    tight = compare_runs(res_b, res, margin=0.05)  # recomputed from the saved per-prompt numbers
    # --record-tokens: each turn's exact prompt ids and speculative output (what benchmarks/methods.py
    # feeds vLLM); without it the JSON holds counts only
    assert all("prompt_ids" not in t for r in res["prompts"] for t in r["turns"])
    assert res_b["config"]["record_tokens"] is True
    for r in res_b["prompts"]:
        for t in r["turns"]:
            assert len(t["prompt_ids"]) == t["prompt_tokens"] and len(t["output_ids"]) == t["spec"]["new_tokens"]
        if len(r["turns"]) == 2:  # turn 2's prompt is turn 1's prompt, its answer, then the new user turn
            first, second = r["turns"][0]["prompt_ids"], r["turns"][1]["prompt_ids"]
            assert second[:len(first)] == first and len(second) > len(first) + 1
    assert all(d["verdict"] == "not shown equivalent" and d["p_low"] > 0.05 for d in tight.values())


def test_eval_cli_device_loop_records_equal_the_host_decoder(tiny_target, draft_dir, prompt_file, tmp_path, capsys):
    """--device-loop (every turn one device program per side) gives the host decoder's records: the
    same prompt and output ids per turn, accept lengths, per-position counts and greedy outputs;
    only the timings differ. At temperature 1 one prompt per program (same keys, same draws); at
    temperature 0 --batch-size 3 (each turn of three prompts one batched program, prompts with one and
    with two turns mixed): the same records again."""
    modes = {"host": [], "device": ["--device-loop"], "batched": ["--device-loop", "--batch-size", "3"]}
    for extra in ((), ("--temperature", "1.0", "--no-greedy")):
        recs = {}
        for mode in (("host", "batched") if not extra else ("host", "device")):
            out = tmp_path / f"{mode}{len(extra)}.json"
            args = _args(tiny_target, draft_dir, prompt_file, out, "--warmup", "0", "--record-tokens", *extra)
            assert main(args + modes[mode]) == 0
            recs[mode] = json.loads(out.read_text())
        loop = "batched" if "batched" in recs else "device"
        assert recs[loop]["config"]["device_loop"] is True and recs["host"]["config"]["device_loop"] is False
        turns = {m: [t for p in r["prompts"] for t in p["turns"]] for m, r in recs.items()}
        assert len(turns["host"]) == len(turns[loop]) >= 4
        if "batched" in recs:
            assert recs["batched"]["config"]["batch_size"] == 3
            assert len(turns["batched"]) == len(turns["host"]) and max(t["batch"] for t in turns["batched"]) == 3
        pairs = [(h, d) for m in turns if m != "host" for h, d in zip(turns["host"], turns[m])]
        for h, d in pairs:
            assert (h["prompt_ids"], h["output_ids"]) == (d["prompt_ids"], d["output_ids"])
            for key in ("new_tokens", "num_steps", "accept_lengths", "accepted_per_position"):
                assert h["spec"][key] == d["spec"][key], key
            if h["greedy"] is not None:
                assert h["greedy"]["new_tokens"] == d["greedy"]["new_tokens"] and h["match"] is d["match"] is True
        assert sum(t["spec"]["num_steps"] for t in turns[loop]) > 0
    capsys.readouterr()


def test_eval_cli_rejects_bad_arguments(tiny_target, tmp_path, capsys):
    assert main(["--target", tiny_target, "--draft", str(tmp_path), "--prompts", "mtbench"]) == 2
    assert "--draft" in capsys.readouterr().err
    assert main(["--target", tiny_target, "--draft", tiny_target, "--num-spec-tokens", "0"]) == 2
    assert "--num-spec-tokens" in capsys.readouterr().err
    assert main(["--target", tiny_target, "--draft", tiny_target, "--compare", "x.json"]) == 2
    assert "--margin" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["--target", tiny_target, "--draft", tiny_target, "--compare", str(bad), "--margin", "1"]) == 2
    assert "not a specjax.eval results file" in capsys.readouterr().err
    assert main(["--target", tiny_target, "--draft", tiny_target, "--batch-size", "4"]) == 2
    assert "--batch-size > 1 needs --device-loop" in capsys.readouterr().err


def test_eval_cli_mismatch_is_an_error(tiny_target, draft_dir, prompt_file, monkeypatch, tmp_path, capsys):
    """A greedy baseline that differs from the speculative output (here: its last token changed)
    must be reported and give exit code 1, with the JSON still written."""
    from specjax.eval import spec_decode

    real = spec_decode.SpecDecoder.greedy

    def altered(self, *a, **kw):
        res = real(self, *a, **kw)
        res.tokens = res.tokens[:-1] + [(res.tokens[-1] + 1) % 300] if res.tokens else [5]
        return res

    monkeypatch.setattr(spec_decode.SpecDecoder, "greedy", altered)
    out = tmp_path / "bad.json"
    rc = main(["--target", tiny_target, "--draft", draft_dir, "--prompts", prompt_file, "--limit", "1",
               "--num-spec-tokens", str(K), "--max-new-tokens", "10", "--warmup", "0", "--out", str(out)])
    assert rc == 1
    assert "differs from greedy output" in capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["mismatches"] == 1
    turn = res["prompts"][0]["turns"][0]
    assert turn["match"] is False and turn["first_divergence"] == turn["spec"]["new_tokens"] - 1
    # a tolerated mismatch (e.g. a bf16 target) still counts in the JSON but exits 0
    assert main(["--target", tiny_target, "--draft", draft_dir, "--prompts", prompt_file, "--limit", "1",
                 "--num-spec-tokens", str(K), "--max-new-tokens", "10", "--warmup", "0", "--out", str(out),
                 "--max-mismatches", "1"]) == 0
    assert json.loads(out.read_text())["mismatches"] == 1


def test_measure_budget_keeps_the_first_whole_prompts(monkeypatch):
    """--budget-s: no prompt starts after the deadline; the finished ones come back in order."""
    from specjax.eval import measure as cli  # the measuring library behind the CLI

    clock = [100.0]
    ran = []

    def fake_run_prompt(decoder, tokenizer, template, p, **kw):
        ran.append(p)
        clock[0] += 10.0  # every prompt takes 10 s
        return {"prompt": p}

    monkeypatch.setattr(cli, "run_prompt", fake_run_prompt)
    monkeypatch.setattr(cli.time, "time", lambda: clock[0])
    recs = cli.measure(None, None, "", ["a", "b", "c", "d", "e"], num_spec_tokens=K, max_new_tokens=4,
                       warmup=1, deadline=135.0)
    # warm-up "a" (100->110), then a (->120), b (->130), c starts at 130 < 135 (->140), d is not started
    assert [r["prompt"] for r in recs] == ["a", "b", "c"] and ran == ["a", "a", "b", "c"]
    assert cli.measure(None, None, "", ["a"], num_spec_tokens=K, max_new_tokens=4, warmup=0, deadline=None)


def test_eval_cli_budget(tiny_target, draft_dir, prompt_file, tmp_path, capsys):
    with pytest.raises(SystemExit):  # argparse names the allowed values
        main(_args(tiny_target, draft_dir, prompt_file, tmp_path / "w.json", "--matmul-precision", "fast"))
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    assert main(_args(tiny_target, draft_dir, prompt_file, tmp_path / "x.json", "--budget-s", "0")) == 2
    assert "--budget-s must be > 0" in capsys.readouterr().err
    # a budget that is over before the first prompt: a clear error, no results file
    assert main(_args(tiny_target, draft_dir, prompt_file, tmp_path / "y.json", "--budget-s", "1e-6")) == 1
    assert "ran out before the first prompt" in capsys.readouterr().err and not (tmp_path / "y.json").exists()
    # a generous budget cuts nothing, and the results say so
    out = tmp_path / "z.json"
    assert main(_args(tiny_target, draft_dir, prompt_file, out, "--budget-s", "3600", "--no-greedy")) == 0
    res = json.loads(out.read_text())
    assert res["cut_by_budget"] is False and res["prompts_measured"] == res["prompts_requested"] == 4

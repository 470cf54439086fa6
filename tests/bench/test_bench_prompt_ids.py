"""specjax.bench records token ids, runs specjax.eval's recorded prompts (--eval-tokens), and
`specjax.bench compare` reads both, against a fake token-level engine (this file's TokenEngine).

The engine: a prompt is token ids (a completions prompt given as ids is taken as it is; text is
"tokenized" one id per character); its output is a fixed function of the prompt ids (`engine_output`),
one token per streamed chunk, stopped at the first of the request's stop_token_ids (kept as the last
output token, as vLLM does) or at max_tokens; its spec-decode counters (vLLM's names) advance per
request by a fixed function of the output (`engine_counts`) just before the final chunk. With
`return_token_ids` it sends the prompt ids in its first chunk (completions: in the choice; chat: at
the top level, as vLLM) and each chunk's token ids. A specjax.eval record built from the same
functions (`eval_record`: outputs cut before the stop token, steps = drafts, accepted per position)
is what a lossless engine reproduces, so `compare --require-equal` must pass on it, and every change
to it must be found."""
from __future__ import annotations

import json
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fake_server import LocalServer  # noqa: E402

from specjax.bench import cli, compare, core  # noqa: E402
from specjax.bench.client import Endpoint, stream_request  # noqa: E402
from specjax.eval.report import RESULTS_FORMAT, RESULTS_VERSION  # noqa: E402

K = 3
EOS = 2
MAX_NEW = 12


def engine_output(prompt_ids, max_tokens, stop_ids):
    """The engine's greedy output for a prompt: an EOS at position 4 + len(prompt) % 5, unless that is
    past max_tokens; cut after the first stop id."""
    out = [(sum(prompt_ids) * 31 + i * 17) % 90 + 5 for i in range(max_tokens)]
    at = 4 + len(prompt_ids) % 5
    if at < max_tokens:
        out[at] = EOS
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[:i + 1]
    return out


def engine_counts(n_out):
    """(drafts, accepted per position) of a request with n_out output tokens."""
    drafts = (n_out + 1) // 2
    return drafts, [drafts // 2, drafts // 3, drafts // 5]


def fake_tokenize(text):
    return [ord(c) % 97 + 3 for c in text]


class TokenEngine(LocalServer):
    def __init__(self, *, refuse_token_ids=False):
        self.refuse_token_ids = refuse_token_ids
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.drafts = 0
        self.per_pos = [0] * K
        server = self
        from http.server import BaseHTTPRequestHandler

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def _send(self, status, data, ctype):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": "tok-model"}]}).encode(), "application/json")
                if self.path == "/metrics":
                    return self._send(200, server.metrics().encode(), "text/plain")
                self._send(404, b"{}", "application/json")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with server.lock:
                    server.bodies.append(body)
                if server.refuse_token_ids and "return_token_ids" in body:
                    return self._send(400, b'{"error": "unknown field return_token_ids"}', "application/json")
                chat = self.path == "/v1/chat/completions"
                prompt = body["messages"][-1]["content"] if chat else body["prompt"]
                ids = fake_tokenize(prompt) if isinstance(prompt, str) else list(prompt)
                out = engine_output(ids, body["max_tokens"], set(body.get("stop_token_ids") or []))
                want_ids = bool(body.get("return_token_ids"))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i, t in enumerate(out):
                    choice = {"index": 0, "finish_reason": None}
                    choice.update({"delta": {"content": f"t{t} "}} if chat else {"text": f"t{t} "})
                    event = {"choices": [choice]}
                    if want_ids:
                        choice["token_ids"] = [t]
                        if i == 0:
                            (event if chat else choice)["prompt_token_ids"] = ids
                    if i == len(out) - 1:
                        server.advance(len(out))
                        choice["finish_reason"] = "stop" if t == EOS else "length"
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                usage = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
                self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

        self._serve(Handler)

    def advance(self, n_out):
        d, acc = engine_counts(n_out)
        with self.lock:
            self.drafts += d
            self.per_pos = [a + b for a, b in zip(self.per_pos, acc)]

    def metrics(self):
        with self.lock:
            lines = [f'vllm:spec_decode_num_drafts_total{{model_name="tok-model"}} {self.drafts}',
                     f'vllm:spec_decode_num_draft_tokens_total{{model_name="tok-model"}} {K * self.drafts}',
                     f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tok-model"}} {sum(self.per_pos)}']
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tok-model",position="{i}"}} {v}'
                      for i, v in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"


def eval_record(prompts, max_new=MAX_NEW):
    """A specjax.eval --record-tokens results dict of what a lossless engine does on `prompts`
    ({(dataset, id): [turn prompt ids, ...]}): outputs cut before the EOS, steps = drafts."""
    recs = []
    for (dataset, pid), turns in prompts.items():
        ts = []
        for ids in turns:
            out = engine_output(ids, max_new, {EOS})
            drafts, acc = engine_counts(len(out))
            ts.append({"prompt_tokens": len(ids), "prompt_ids": list(ids), "output_ids": [t for t in out if t != EOS],
                       "spec": {"num_steps": drafts, "accepted_per_position": acc, "accept_lengths": [],
                                "new_tokens": len(out)}})
        recs.append({"id": pid, "dataset": dataset, "category": None, "turns": ts})
    return {"format": RESULTS_FORMAT, "format_version": RESULTS_VERSION, "prompts": recs,
            "config": {"num_spec_tokens": K, "max_new_tokens": max_new, "temperature": 0.0, "eos_token_ids": [EOS],
                       "dtype": "float32", "record_tokens": True, "target": "/t", "draft": "/d"}}


PROMPTS = {("mt", "a"): [[5, 6, 7], [5, 6, 7, 40, 41, 9]], ("mt", "b"): [[11, 12, 13, 14]],
           ("he", "c"): [[20, 21, 22, 23, 24, 25, 26]]}


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def test_stream_request_returns_token_ids():
    with TokenEngine() as srv:
        ep = Endpoint.parse(srv.url)
        rec = stream_request(ep, "tok-model", prompt=[9, 8, 7], max_tokens=6, return_token_ids=True,
                             extra_body={"stop_token_ids": [EOS]})
        assert rec["ok"] and rec["prompt_token_ids"] == [9, 8, 7]
        assert rec["output_token_ids"] == engine_output([9, 8, 7], 6, {EOS}) and rec["output_tokens"] == 6
        assert srv.bodies[-1]["prompt"] == [9, 8, 7] and srv.bodies[-1]["return_token_ids"] is True
        rec = stream_request(ep, "tok-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                             return_token_ids=True)
        assert rec["prompt_token_ids"] == fake_tokenize("hi")  # chat: at the chunk's top level
        assert rec["output_token_ids"] == engine_output(fake_tokenize("hi"), 5, set())
        rec = stream_request(ep, "tok-model", prompt="hi", max_tokens=5)  # not asked: none kept or sent
        assert rec["ok"] and rec["prompt_token_ids"] is None and rec["output_token_ids"] is None
        assert "return_token_ids" not in srv.bodies[-1]


def test_eval_tokens_run_and_compare_equal(tmp_path, capsys):
    ev = _write(tmp_path / "eval.json", eval_record(PROMPTS))
    out = tmp_path / "bench"
    with TokenEngine() as srv:
        rc = cli.main(["--url", srv.url, "--eval-tokens", ev, "--concurrency", "1", "--no-progress", "--no-plots",
                       "--out", str(out), "--server-flags", "vllm serve /t --dtype float32"])
        assert rc == 0, capsys.readouterr().err
        sent = [b for b in srv.bodies]
    # warm-up + one request per turn, each the recorded ids with the run's settings
    turns = [ids for ts in PROMPTS.values() for ids in ts]
    assert [b["prompt"] for b in sent[1:]] == turns
    for b in sent:
        assert (b["max_tokens"], b["temperature"], b["stop_token_ids"]) == (MAX_NEW, 0.0, [EOS])
        assert b["return_token_ids"] is True and b["repetition_penalty"] == 1.0 and b["frequency_penalty"] == 0.0
    res = json.load(open(out / "results.json"))
    assert res["format_version"] == 2 and res["prompts"]["token_ids"] is True
    assert res["config"]["endpoint"] == "completions" and res["config"]["max_tokens"] == MAX_NEW
    reqs = sorted(res["arms"]["spec"]["levels"][0]["requests"], key=lambda r: r["index"])
    assert [(r["dataset"], r["job_id"], r["turn"]) for r in reqs] == [("mt", "a", 0), ("mt", "a", 1), ("mt", "b", 0),
                                                                     ("he", "c", 0)]
    for r, ids in zip(reqs, turns):
        out_ids = engine_output(ids, MAX_NEW, {EOS})
        assert r["prompt_token_ids"] == ids and r["prompt_token_ids_from"] == "server"
        assert r["output_token_ids"] == out_ids
        d, acc = engine_counts(len(out_ids))  # this request's own counters, from the scrapes around it
        assert r["spec"] == {"drafts": d, "draft_tokens": K * d, "accepted": sum(acc), "accepted_per_pos": acc}
    capsys.readouterr()

    cmp_json = tmp_path / "cmp.json"
    assert cli.main(["compare", ev, str(out), "--require-equal", "--out", str(cmp_json)]) == 0
    printed = capsys.readouterr().out
    cmp = json.loads(cmp_json.read_text())
    assert cmp["turns"] == cmp["equal_turns"] == 4 and cmp["engine"]["server_dtype"] == "float32"
    assert all(r["match"] == "token ids" and r["inputs_verified"] for r in cmp["rows"])
    steps = sum(engine_counts(len(engine_output(ids, MAX_NEW, {EOS})))[0] for ids in turns)
    assert cmp["totals"]["all"]["eval_steps"] == cmp["totals"]["all"]["engine_drafts"] == steps
    assert set(cmp["totals"]) == {"mt", "he", "all"}
    assert "mt/a" in printed and "all: 4/4 turns equal" in printed and "dataset he: 1/1 turns equal" in printed


def test_eval_tokens_limit_and_concurrency_two(tmp_path, capsys):
    ev = _write(tmp_path / "eval.json", eval_record(PROMPTS))
    out = tmp_path / "bench"
    with TokenEngine() as srv:
        rc = cli.main(["--url", srv.url, "--eval-tokens", ev, "--limit", "2", "--concurrency", "2", "--no-progress",
                       "--no-plots", "--out", str(out)])
        assert rc == 0
        assert len(srv.bodies) == 1 + 3  # prompts a (2 turns) and b
    reqs = json.load(open(out / "results.json"))["arms"]["spec"]["levels"][0]["requests"]
    assert all("spec" not in r and r["output_token_ids"] for r in reqs)  # no per-request counters above 1
    capsys.readouterr()
    assert cli.main(["compare", ev, str(out)]) == 2
    assert "per-request counters exist at concurrency 1 only" in capsys.readouterr().err
    assert cli.main(["compare", ev, str(out), "--concurrency", "2", "--require-equal"]) == 1
    o = capsys.readouterr()
    assert "no per-request counters" in o.out and "missing" in o.out and "4 turns differ" in o.err


def test_server_refusing_token_ids_is_a_warning(tmp_path, capsys):
    ev = _write(tmp_path / "eval.json", eval_record(PROMPTS))
    out = tmp_path / "bench"
    with TokenEngine(refuse_token_ids=True) as srv:
        rc = cli.main(["--url", srv.url, "--eval-tokens", ev, "--concurrency", "1", "--no-progress", "--no-plots",
                       "--out", str(out)])
        assert rc == 0
    assert "refused the request field return_token_ids" in capsys.readouterr().err
    res = json.load(open(out / "results.json"))
    assert res["prompts"]["token_ids"] is False
    reqs = res["arms"]["spec"]["levels"][0]["requests"]
    # the ids sent are still recorded (marked as such); outputs are unknown
    assert all(r["prompt_token_ids_from"] == "sent" and r["output_token_ids"] is None for r in reqs)
    assert cli.main(["compare", ev, str(out), "--require-equal"]) == 1
    assert "unverified" in capsys.readouterr().out


def test_chat_runs_record_token_ids_too():
    jobs = [core.BenchJob("q", "chat", ("hello",))]
    with TokenEngine() as srv:
        res = core.run_level(Endpoint.parse(srv.url), "tok-model", jobs, 1, max_tokens=4, return_token_ids=True)
    (r,) = res["requests"]
    assert r["prompt_token_ids"] == fake_tokenize("hello") and r["prompt_token_ids_from"] == "server"
    assert r["spec"]["drafts"] == engine_counts(4)[0]
    with pytest.raises(ValueError, match="token ids: send it to /v1/completions"):
        core.run_level(Endpoint.parse("http://127.0.0.1:9"), "m", [core.BenchJob("x", "d", (), prompt_ids=(1,))], 1,
                       max_tokens=4)


def test_eval_tokens_refusals(tmp_path, capsys):
    rec = eval_record(PROMPTS)
    ev = _write(tmp_path / "eval.json", rec)
    with pytest.raises(SystemExit):
        cli.main(["--url", "http://127.0.0.1:9", "--eval-tokens", ev, "--prompts", "mtbench"])
    assert "drop --prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--url", "http://127.0.0.1:9", "--eval-tokens", ev, "--endpoint", "chat"])
    for turn in rec["prompts"][0]["turns"]:
        del turn["prompt_ids"]
    bare = _write(tmp_path / "bare.json", rec)
    with TokenEngine() as srv:
        assert cli.main(["--url", srv.url, "--eval-tokens", bare, "--no-progress"]) == 2
        assert "run specjax.eval with --record-tokens" in capsys.readouterr().err
        assert srv.bodies == []
    jobs = compare.jobs_from_eval(eval_record(PROMPTS), limit=1)
    assert [(j.id, j.turn, j.prompt_ids) for j in jobs] == [("a", 0, (5, 6, 7)), ("a", 1, (5, 6, 7, 40, 41, 9))]

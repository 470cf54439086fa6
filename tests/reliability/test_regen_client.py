"""The OpenAI-compatible regeneration client against a fake server on 127.0.0.1 (in a thread):
retries with backoff, give-up, per-request timeout, no retry on 4xx, real concurrency, API-key
redaction, request bodies, reasoning kept/stripped."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest

from specjax.regen.client import ChatClient, EndpointError
from specjax.regenerate import main as regen_main
from specjax.regenerate import regenerate

KEY = "sk-test-0123456789SECRETkey"


class FakeServer:
    """Each request pops the next action from `plan` (when empty: `default`). An action is a dict:
    status, body (dict -> JSON), headers, sleep (seconds before answering)."""

    def __init__(self):
        self.plan: list[dict] = []
        self.default: dict = {"status": 200}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep the test output quiet
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(n)
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "raw": raw,
                                            "body": json.loads(raw)})
                    action = server.plan.pop(0) if server.plan else server.default
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    time.sleep(action.get("sleep", 0))
                    body = action.get("body")
                    if body is None:
                        body = server.completion(json.loads(raw))
                    data = json.dumps(body).encode()
                    self.send_response(action.get("status", 200))
                    for k, v in action.get("headers", {}).items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout)
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @staticmethod
    def completion(req: dict, content: str | None = None, reasoning: str | None = None) -> dict:
        last = req["messages"][-1]["content"]
        msg = {"role": "assistant", "content": content if content is not None else f"answer to: {last}"}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        return {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                "usage": {"completion_tokens": 7}}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def _ok(content="fine", reasoning=None):
    return {"status": 200, "body": FakeServer.completion({"messages": [{"content": ""}]}, content, reasoning)}


def _client(server, **kw):
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return ChatClient(server.url, "m", **kw)


MSGS = [{"role": "user", "content": "hi"}]


def test_retries_500_429_timeout_then_success(server):
    server.plan = [
        {"status": 500, "body": {"error": {"message": "boom"}}},
        {"status": 429, "body": {"error": "slow down"}, "headers": {"Retry-After": "0.2"}},
        {"sleep": 1.5},  # longer than the timeout below
        {"status": 502, "body": "bad gateway"},
        _ok("done"),
    ]
    slept = []
    c = _client(server, max_retries=4, timeout_s=0.5, sleep=lambda s: (slept.append(s), time.sleep(s)))
    resp = c.chat(MSGS, max_tokens=8, temperature=0.0, top_p=1.0)
    assert resp["choices"][0]["message"]["content"] == "done"
    assert len(server.requests) == 5
    assert len(slept) == 4
    assert slept[1] >= 0.2  # Retry-After honoured
    # exponential backoff: base 0.01 * 2**attempt plus up to 50 % jitter
    for attempt, s in [(0, slept[0]), (2, slept[2]), (3, slept[3])]:
        assert 0.01 * 2**attempt <= s <= 0.015 * 2**attempt + 1e-9


def test_gives_up_after_max_retries_with_a_clear_error(server):
    server.default = {"status": 503, "body": {"error": {"message": "overloaded"}}}
    c = _client(server, max_retries=2)
    with pytest.raises(EndpointError) as e:
        c.chat(MSGS, max_tokens=8, temperature=0.0, top_p=1.0, what="row 3")
    msg = str(e.value)
    assert "row 3" in msg and "gave up after 3 attempts" in msg and "HTTP 503: overloaded" in msg
    assert "--max-retries" in msg
    assert len(server.requests) == 3


def test_per_request_timeout(server):
    server.default = {"sleep": 3.0}
    c = _client(server, max_retries=0, timeout_s=0.4)
    t = time.monotonic()
    with pytest.raises(EndpointError, match="0.4 s timeout"):
        c.chat(MSGS, max_tokens=8, temperature=0.0, top_p=1.0)
    assert time.monotonic() - t < 2.0  # well before the server would answer (3 s)


def test_connection_refused_is_retried_then_reported():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    c = ChatClient(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_base_s=0.01, timeout_s=2)
    with pytest.raises(EndpointError, match="gave up after 2 attempts.*connection error"):
        c.chat(MSGS, max_tokens=8, temperature=0.0, top_p=1.0)


def test_4xx_is_not_retried(server):
    server.default = {"status": 400, "body": {"error": {"message": "top_p must be in (0, 1]"}}}
    c = _client(server, max_retries=5)
    with pytest.raises(EndpointError) as e:
        c.chat(MSGS, max_tokens=8, temperature=0.0, top_p=1.0)
    assert "HTTP 400: top_p must be in (0, 1]" in str(e.value) and e.value.status == 400
    assert len(server.requests) == 1


def _write_input(tmp_path, n):
    rows = []
    for i in range(n):
        rows.append({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"old answer {i}"},
        ]})
    rows.append({"messages": [{"role": "system", "content": "nothing to answer"}]})
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_concurrency_bodies_and_output(server, tmp_path):
    server.default = {"status": 200, "sleep": 0.25}
    src = _write_input(tmp_path, 8)
    out = tmp_path / "out"
    s = regenerate(input=str(src), out_dir=str(out), backend="openai", endpoint=server.url, model="tiny",
                   concurrency=4, max_new_tokens=16, temperature=0.5, top_p=0.9, shard_size=3,
                   extra_body={"seed": 1}, backoff_base_s=0.01)
    # concurrency 4 (3 per shard here): requests really overlapped at the server. (Wall time is no
    # evidence on a loaded 2-core CI machine: it was 2.10 s for 2.0 s of sequential sleeps once.)
    assert server.max_in_flight >= 3, server.max_in_flight
    assert s.written == 8 and s.skipped == {"no user turn to answer": 1} and s.tokens_generated == 8 * 7
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-000000.parquet", "shard-000001.parquet",
                                       "shard-000002.parquet"]
    # bodies: exactly the prompt turns (trailing assistant dropped) + sampling + the configured key
    for r in server.requests:
        b = r["body"]
        assert set(b) == {"model", "messages", "max_tokens", "temperature", "top_p", "seed"}
        assert (b["model"], b["max_tokens"], b["temperature"], b["top_p"], b["seed"]) == ("tiny", 16, 0.5, 0.9, 1)
        i = int(b["messages"][1]["content"].split()[-1])
        assert b["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": f"question {i}"}]
        assert str(tmp_path) not in r["raw"].decode() and r["path"] == "/v1/chat/completions"
        assert "Authorization" not in r["headers"]  # no key configured -> no header
    rows = pq.read_table(out / "shard-000001.parquet").to_pylist()
    assert [r["source_index"] for r in rows] == [3, 4, 5]
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "answer to: question 3"}
    assert len(rows[0]["messages"]) == 3


def test_api_key_only_in_header_and_redacted_everywhere(server, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("MY_KEY", KEY)
    echo = {"error": {"message": f"Incorrect API key provided: {KEY}"}}
    server.plan = [{"status": 500, "body": echo}, _ok()]
    src = _write_input(tmp_path, 1)
    out = tmp_path / "out"
    with caplog.at_level(logging.DEBUG):
        regenerate(input=str(src), out_dir=str(out), backend="openai", endpoint=server.url, model="m",
                   api_key_env="MY_KEY", backoff_base_s=0.01)
    assert server.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"
    assert all(KEY not in r["raw"].decode() for r in server.requests)
    assert "[REDACTED]" in caplog.text and KEY not in caplog.text  # the retry warning echoed it
    manifest = (out / "manifest.json").read_text()
    assert KEY not in manifest and json.loads(manifest)["api_key_env"] == "MY_KEY"

    # a refused key: the error (and the CLI's message) name the problem without the key
    server.default = {"status": 401, "body": echo}
    caplog.clear()
    with pytest.raises(EndpointError) as e:
        regenerate(input=str(src), out_dir=str(tmp_path / "out2"), backend="openai", endpoint=server.url,
                   model="m", api_key_env="MY_KEY", backoff_base_s=0.01)
    assert KEY not in str(e.value) and "[REDACTED]" in str(e.value) and "$MY_KEY" in str(e.value)
    with caplog.at_level(logging.DEBUG):
        rc = regen_main(["--input", str(src), "--out", str(tmp_path / "out3"), "--backend", "openai",
                         "--endpoint", server.url, "--model", "m", "--api-key-env", "MY_KEY"])
    err = capsys.readouterr().err
    assert rc == 1 and "HTTP 401" in err and KEY not in err and KEY not in caplog.text


@pytest.mark.parametrize("keep", [True, False])
def test_reasoning_kept_or_stripped(server, tmp_path, keep):
    server.plan = [_ok("The answer is 4.", reasoning="2 plus 2 is 4."),
                   _ok("<think>\ncount up\n</think>\n\nFive.")]
    src = _write_input(tmp_path, 2)
    out = tmp_path / "out"
    regenerate(input=str(src), out_dir=str(out), backend="openai", endpoint=server.url, model="m",
               concurrency=1, keep_reasoning=keep)
    got = [r["messages"][-1]["content"] for r in pq.read_table(out / "shard-000000.parquet").to_pylist()]
    if keep:
        assert got == ["<think>\n2 plus 2 is 4.\n</think>\n\nThe answer is 4.", "<think>\ncount up\n</think>\n\nFive."]
    else:
        assert got == ["The answer is 4.", "Five."]


def test_redactor_filter_cleans_log_records(caplog):
    from specjax.regen.common import Redactor

    lg = logging.getLogger("specjax.regen.test")
    r = Redactor(KEY, None, "ab")  # None and very short values are not secrets
    lg.addFilter(r)
    try:
        with caplog.at_level(logging.INFO, logger="specjax.regen.test"):
            lg.info("sending %s to %s", f"Bearer {KEY}", "host")
            try:
                raise RuntimeError(f"server said {KEY}")
            except RuntimeError:
                lg.exception("request failed")
    finally:
        lg.removeFilter(r)
    assert KEY not in caplog.text and caplog.text.count("[REDACTED]") == 2
    assert "Bearer [REDACTED] to host" in caplog.text and r.redact("about") == "about"

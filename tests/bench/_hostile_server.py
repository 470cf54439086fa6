"""A misbehaving OpenAI-compatible server for the bench's robustness tests (stdlib http.server in a
thread, 127.0.0.1, port 0). What a POST does is named by the last user message (the prompt): one of
BEHAVIOURS. Every behaviour is bounded: at most `limit_s` seconds and `huge_bytes` bytes, and it
stops as soon as the client hangs up, so a client that misbehaves in turn cannot hang a test.

* ok: three text chunks (1 token each), usage, `data: [DONE]`.
* keepalive: SSE comment lines (`: keep-alive`) every `tick_s`, never an event.
* slow-tokens: a one-token text event every `tick_s`, never `[DONE]`.
* slow-headers: the status line, then one header byte every `tick_s`.
* silent: the headers, then nothing.
* no-done: three text events (finish_reason "stop" on the last), usage, then the connection
  closes without `[DONE]` (HTTP/1.0).
* no-done-chunked: the same over HTTP/1.1 chunked encoding, ended by its proper zero-length chunk.
* cut-chunk: HTTP/1.1 chunked; after the three events a chunk announces more bytes than are sent,
  then the connection closes.
* mid-event: two text events, then half of a third (`data: {"choices":[{"delta":{"content":"ab`)
  and the connection closes.
* huge-events: 64 KiB text events up to `huge_bytes`, then `[DONE]`.
* huge-line: `data: {"choices":[{"delta":{"content":"` followed by `huge_bytes` of 'x', no newline.
* huge-error: HTTP 500 with a `huge_bytes` body.
* deep-json: an event nested 100,000 levels deep.
* not-object: an event that is a JSON list.

GET /metrics answers `metrics_page` (a string, or a callable returning one), GET /v1/models one
model."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

from _fake_server import LocalServer

BEHAVIOURS = ("ok", "keepalive", "slow-tokens", "slow-headers", "silent", "no-done", "no-done-chunked",
              "cut-chunk", "mid-event", "huge-events", "huge-line", "huge-error", "deep-json", "not-object")

# a vLLM-like page whose per-position counter claims draft position 10^7
POSITION_BOMB_PAGE = "\n".join([
    "# TYPE vllm:spec_decode_num_drafts counter",
    'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0',
    'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0',
    'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 3.0',
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 2.0',
    'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="10000000"} 1.0',
]) + "\n"


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _token(text: str, finish=None) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


THREE_TOKENS = _token("a ") + _token("b ") + _token("c", "stop")
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})


class HostileServer(LocalServer):
    def __init__(self, *, limit_s: float = 15.0, tick_s: float = 0.2, huge_bytes: int = 200 << 20,
                 metrics_page=POSITION_BOMB_PAGE, model: str = "m"):
        self.limit_s, self.tick_s, self.huge_bytes = limit_s, tick_s, huge_bytes
        self.metrics_page, self.model = metrics_page, model
        self.lock = threading.Lock()
        self.posts: list[str] = []
        self.bytes_sent: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):  # quiet
                pass

            def _send(self, data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()

            def _head(self, status=200, ctype="text/event-stream", chunked=False):
                if chunked:
                    self.protocol_version = "HTTP/1.1"
                    self.close_connection = True
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()

            def do_GET(self):
                if self.path == "/v1/models":
                    data = json.dumps({"object": "list", "data": [{"id": server.model}]}).encode()
                elif self.path == "/metrics":
                    page = server.metrics_page() if callable(server.metrics_page) else server.metrics_page
                    data = page.encode()
                else:
                    data = b'{"error": "not found"}'
                self.send_response(200 if self.path in ("/v1/models", "/metrics") else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                what = (body["messages"][-1]["content"] if "messages" in body else body["prompt"]).strip()
                with server.lock:
                    server.posts.append(what)
                sent = 0
                try:
                    sent = self._behave(what)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client hung up: what a bounded client does
                finally:
                    with server.lock:
                        server.bytes_sent[what] = server.bytes_sent.get(what, 0) + sent

            def _behave(self, what: str) -> int:
                t_end = time.monotonic() + server.limit_s
                if what == "ok":
                    self._head()
                    self._send(THREE_TOKENS + USAGE + b"data: [DONE]\n\n")
                    return len(THREE_TOKENS)
                if what in ("keepalive", "slow-tokens"):
                    self._head()
                    piece = b": keep-alive\n\n" if what == "keepalive" else _token("t ")
                    sent = 0
                    while time.monotonic() < t_end:
                        self._send(piece)
                        sent += len(piece)
                        time.sleep(server.tick_s)
                    return sent
                if what == "slow-headers":
                    self._send(b"HTTP/1.0 200 OK\r\n")
                    sent = 0
                    while time.monotonic() < t_end:
                        self._send(b"X")
                        sent += 1
                        time.sleep(server.tick_s)
                    return sent
                if what == "silent":
                    self._head()
                    time.sleep(server.limit_s)
                    return 0
                if what == "no-done":
                    self._head()
                    self._send(THREE_TOKENS + USAGE)
                    return len(THREE_TOKENS)
                if what in ("no-done-chunked", "cut-chunk"):
                    self._head(chunked=True)
                    data = THREE_TOKENS + USAGE
                    self._send(b"%x\r\n" % len(data) + data + b"\r\n")
                    # a proper end of the chunked body, or a chunk announcing 256 bytes of which 20 come
                    self._send(b"0\r\n\r\n" if what == "no-done-chunked" else b"100\r\n" + b"data: {\"choices\": [")
                    return len(data)
                if what == "mid-event":
                    self._head()
                    self._send(_token("a ") + _token("b ") + b'data: {"choices":[{"delta":{"content":"ab')
                    return 0
                if what == "huge-events":
                    self._head()
                    piece = _token("x" * 65536)
                    sent = 0
                    while sent < server.huge_bytes and time.monotonic() < t_end:
                        self._send(piece)
                        sent += len(piece)
                    self._send(b"data: [DONE]\n\n")
                    return sent
                if what in ("huge-line", "huge-error"):
                    if what == "huge-line":
                        self._head()
                        self._send(b'data: {"choices":[{"delta":{"content":"')
                    else:
                        self._head(status=500, ctype="text/plain")
                    block = b"x" * (1 << 20)
                    sent = 0
                    while sent < server.huge_bytes and time.monotonic() < t_end:
                        self._send(block)
                        sent += len(block)
                    return sent
                if what == "deep-json":
                    self._head()
                    self._send(b"data: " + b"[" * 100_000 + b"\n\n")
                    return 0
                if what == "not-object":
                    self._head()
                    self._send(b"data: [1, 2, 3]\n\n" + b"data: [DONE]\n\n")
                    return 0
                self._head(status=400, ctype="text/plain")
                self._send(f"unknown behaviour {what!r}; one of {BEHAVIOURS}".encode())
                return 0

        self._serve(Handler)

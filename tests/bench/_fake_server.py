"""A tiny OpenAI-compatible server for the bench tests (stdlib http.server in a thread, 127.0.0.1,
port 0): it streams SSE chunks with known timings and serves /metrics with vLLM-named spec-decode
counters that advance by known amounts per request.

Every request answers with `len(chunk_tokens)` text chunks: the first after `ttft_s`, the next ones
`gap_s` apart; chunk i stands for `chunk_tokens[i]` tokens and usage.completion_tokens is their sum.
A request whose last user message contains the tag `pN` (p0, p1, ...) advances the counters by
`increments[N % len(increments)]` (drafts, draft_tokens, accepted per position) just before its final
chunk, so the client sees the counters of a request updated by the time its stream ends (as vLLM
does). A user message containing `FAIL` is answered with HTTP 500. With `reply(text, body)` given,
the answer's text is what it returns for the last user message (and the request body), cut into
`len(chunk_tokens)` chunks; the token counts stay those of `chunk_tokens`."""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# (drafts, accepted per position) for prompts p0, p1, p2, ... (K = 3)
DEFAULT_INCREMENTS = (
    (4, (3, 2, 1)),
    (5, (2, 1, 0)),
    (3, (3, 3, 2)),
    (6, (1, 0, 0)),
)


class LocalServer:
    """An http.server on 127.0.0.1 (a free port) serving from a daemon thread while in a `with` block."""

    def _serve(self, handler) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class FakeServer(LocalServer):
    def __init__(self, *, spec: bool = True, model: str = "fake-model", ttft_s: float = 0.05, gap_s: float = 0.02,
                 chunk_tokens=(1, 3, 2, 3), increments=DEFAULT_INCREMENTS, num_spec_tokens: int = 3,
                 total_suffix: bool = True, usage: bool = True, engines: int = 1, reply=None):
        self.spec, self.model = spec, model
        self.ttft_s, self.gap_s, self.chunk_tokens = ttft_s, gap_s, tuple(chunk_tokens)
        self.increments, self.k = increments, num_spec_tokens
        self.total_suffix, self.usage, self.engines = total_suffix, usage, engines
        self.reply = reply
        self.lock = threading.Lock()
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * num_spec_tokens
        self.bodies: list[dict] = []
        self.metrics_reads = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the connection closes after each answer (ends the SSE stream)

            def log_message(self, *a):  # quiet
                pass

            def _json(self, obj, status=200):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._json({"object": "list", "data": [{"id": server.model, "object": "model"}]})
                if self.path == "/version":
                    return self._json({"version": "fake-0.1"})
                if self.path == "/metrics":
                    data = server.metrics_text().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self._json({"error": "not found"}, 404)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                with server.lock:
                    server.bodies.append(body)
                chat = self.path == "/v1/chat/completions"
                if not chat and self.path != "/v1/completions":
                    return self._json({"error": "not found"}, 404)
                text = body["messages"][-1]["content"] if chat else body["prompt"]
                if "FAIL" in text:
                    return self._json({"error": {"message": "boom"}}, 500)
                m = re.search(r"\bp(\d+)\b", text)
                tag = int(m.group(1)) if m else 0
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def event(obj):
                    self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                    self.wfile.flush()

                def choice(piece, finish=None):
                    if chat:
                        return {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
                    return {"index": 0, "text": piece, "finish_reason": finish}

                if chat:
                    event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]})
                time.sleep(server.ttft_s)
                last = len(server.chunk_tokens) - 1
                pieces = ["tok " * nt for nt in server.chunk_tokens]
                if server.reply is not None:
                    full, n = server.reply(text, body), len(server.chunk_tokens)
                    pieces = [full[i * len(full) // n:(i + 1) * len(full) // n] for i in range(n)]
                for i, piece in enumerate(pieces):
                    if i:
                        time.sleep(server.gap_s)
                    if i == last:
                        server.advance(tag)
                    event({"choices": [choice(piece, ("length" if server.reply is None else "stop") if i == last
                                              else None)]})
                if server.usage:
                    event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": sum(server.chunk_tokens),
                                                    "total_tokens": 7 + sum(server.chunk_tokens)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self._serve(Handler)

    # counters --------------------------------------------------------------------------------
    def expected_increment(self, tag: int) -> tuple[int, tuple[int, ...]]:
        return self.increments[tag % len(self.increments)]

    def advance(self, tag: int) -> None:
        if not self.spec:
            return
        d, acc = self.expected_increment(tag)
        with self.lock:
            self.drafts += d
            self.draft_tokens += d * self.k
            self.accepted += sum(acc)
            for i, a in enumerate(acc):
                self.per_pos[i] += a

    def metrics_text(self) -> str:
        """vLLM-like page: the spec-decode counters (split over `engines` series), their `_created`
        gauges (which must be ignored), and unrelated metrics around them."""
        with self.lock:
            self.metrics_reads += 1
            vals = (self.drafts, self.draft_tokens, self.accepted, list(self.per_pos))
        sfx = "_total" if self.total_suffix else ""
        lab = f'model_name="{self.model}"'
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{engine="0",{lab}}} 0.0',
                 "# TYPE vllm:e2e_request_latency_seconds histogram",
                 f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",{lab}}} 3.0',
                 f'vllm:e2e_request_latency_seconds_sum{{engine="0",{lab}}} 1.5']
        if self.spec:
            def split(v):  # engine 0 gets the remainder: the sum over series is v
                share = v // self.engines
                return [v - share * (self.engines - 1)] + [share] * (self.engines - 1)

            for name, v in (("drafts", vals[0]), ("draft_tokens", vals[1]), ("accepted_tokens", vals[2])):
                fam = f"vllm:spec_decode_num_{name}"
                lines += [f"# HELP {fam}{sfx} Number of spec decoding {name}.", f"# TYPE {fam}{sfx} counter"]
                lines += [f'{fam}{sfx}{{engine="{e}",{lab}}} {float(x)}' for e, x in enumerate(split(v))]
                lines += [f"# TYPE {fam}_created gauge", f'{fam}_created{{engine="0",{lab}}} 1.7e9']
            fam = "vllm:spec_decode_num_accepted_tokens_per_pos"
            lines += [f"# TYPE {fam}{sfx} counter"]
            for pos, v in enumerate(vals[3]):
                lines += [f'{fam}{sfx}{{engine="{e}",{lab},position="{pos}"}} {float(x)}'
                          for e, x in enumerate(split(v))]
                lines += [f'{fam}_created{{engine="0",{lab},position="{pos}"}} 1.7e9']
        return "\n".join(lines) + "\n"

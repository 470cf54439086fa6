"""HTTP side of the benchmark: an OpenAI-compatible streaming client on the standard library.

One request = one POST to `/v1/chat/completions` (messages) or `/v1/completions` (a prompt
string) with `stream: true` and `stream_options: {"include_usage": true}`. The client reads the
server-sent events as they arrive and stamps every chunk that carries text with
`time.perf_counter()`, so per request it knows:

* `ttft_s`: from just before the request is sent to the first chunk with text;
* `e2e_s`: to the end of the stream (`data: [DONE]`);
* `output_tokens`: the server's `usage.completion_tokens` (the final usage chunk), or, when the
  server sends no usage, the number of text chunks (`tokens_source` says which);
* `itl_s`: the mean inter-token latency after the first token, (t_last - t_first) / (tokens - 1)
  (vLLM's "TPOT"; with speculation several tokens share a chunk, so per-chunk gaps are not it);
* `chunk_times_s`: the arrival time of every text chunk (relative to the send);
* `prompt_token_ids` / `output_token_ids`: with `return_token_ids` (vLLM's request field of that
  name), the prompt's token ids as the server tokenized them (vLLM sends them in its first chunk)
  and the output's, concatenated from every chunk's `token_ids` (the stop token included); None
  when the server sent none.

A prompt for `/v1/completions` may be a list of token ids: the server then decodes exactly those
ids (no tokenization, no template), which is how `specjax.bench --eval-tokens` repeats
specjax.eval's inputs.

Bounds, so that a misbehaving server costs a counted failed request and never a hang or the
machine's memory (a failure does not raise: the record has `ok: False` and `error`):

* a whole-request deadline (`timeout`, the CLI's `--request-timeout`): connect, headers and the
  whole stream. A watchdog shuts the socket down when it passes, so a server that trickles bytes
  (a keep-alive line every second) cannot extend it. Default `default_request_timeout(max_tokens)`
  = 60 s + max_tokens / 2 s: a reply of max_tokens tokens at 2 tokens/s (a slow CPU server at
  concurrency) plus a minute of queueing and prefill; 188 s at max_tokens 256. Error: "no complete
  reply within N s (--request-timeout)". `idle_timeout` (optional, `--idle-timeout`) also fails a
  request when the server sends nothing for that long.
* a reply-size cap (`max_reply_bytes`, `--max-reply-bytes`): the response body is read in pieces
  and a reply beyond the cap is abandoned ("reply exceeded N bytes"). Default
  `default_max_reply_bytes(max_tokens)` = max(1 MiB, 4 KiB per token); a record's text is never
  larger than that.
* a complete stream ends with `data: [DONE]` (vLLM and SGLang always send it, after an error event
  too). A stream that ends without it (the connection closed, a chunked body ended or cut, or the
  last event cut in the middle) is a failed request: "stream ended before [DONE] after N tokens",
  whatever finish_reason it carried.
* events that are not JSON objects (or are nested too deeply to parse) fail the request ("bad
  event"); a non-200 answer shows at most 4 KiB of its body.

The small GET requests (`/v1/models`, `/version`, `/metrics`) have the same deadline watchdog and
a cap on the body read (`max_bytes`; `/metrics`: `MAX_METRICS_BYTES`).

No third-party HTTP library is used; each request opens its own connection (thread-safe, and on
localhost the cost is negligible next to a generation)."""
from __future__ import annotations

import http.client
import json
import math
import os
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional, Union

__all__ = ["Endpoint", "ServerError", "request_json", "fetch_text", "fetch_metrics_text", "list_models",
           "server_version", "stream_request", "api_key_from_env", "default_request_timeout",
           "default_max_reply_bytes", "MAX_METRICS_BYTES", "MAX_JSON_BYTES"]

# --request-timeout default: a reply of max_tokens at this rate, plus this much for queueing/prefill
SLOWEST_TOKENS_PER_S = 2.0
QUEUE_AND_PREFILL_S = 60.0
# --max-reply-bytes default: SSE framing and JSON around one token are a few hundred bytes in vLLM's
# chunks (more with logprobs); 4 KiB a token leaves room, 1 MiB is the floor for short replies
REPLY_BYTES_PER_TOKEN = 4096
MIN_MAX_REPLY_BYTES = 1 << 20
MAX_METRICS_BYTES = 8 << 20  # a vLLM page is ~60 KB per engine
MAX_JSON_BYTES = 1 << 20  # /v1/models, /version
ERROR_BODY_BYTES = 4096  # read of a non-200 answer
READ_SIZE = 1 << 16


class ServerError(RuntimeError):
    """The server could not be reached, or answered with an error status."""


def default_request_timeout(max_tokens: int) -> float:
    """The whole-request deadline used when none is given (see the module docstring)."""
    return QUEUE_AND_PREFILL_S + max(int(max_tokens), 0) / SLOWEST_TOKENS_PER_S


def default_max_reply_bytes(max_tokens: int) -> int:
    """The reply-size cap used when none is given (see the module docstring)."""
    return max(MIN_MAX_REPLY_BYTES, REPLY_BYTES_PER_TOKEN * max(int(max_tokens), 0))


@dataclass(frozen=True)
class Endpoint:
    """Where a server is: base URL (scheme://host:port[/prefix], without `/v1`), and an API key."""
    url: str
    api_key: Optional[str] = None

    @classmethod
    def parse(cls, url: str, api_key: Optional[str] = None) -> "Endpoint":
        u = url.strip().rstrip("/")
        if "://" not in u:
            u = "http://" + u
        if u.endswith("/v1"):
            u = u[:-3]
        p = urllib.parse.urlsplit(u)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"--url {url!r}: expected http://HOST:PORT (the server's base URL)")
        return cls(u, api_key)

    def _split(self) -> tuple[str, str, int, str]:
        p = urllib.parse.urlsplit(self.url)
        port = p.port or (443 if p.scheme == "https" else 80)
        return p.scheme, p.hostname, port, p.path.rstrip("/")

    def connect(self, timeout: float) -> tuple[http.client.HTTPConnection, str]:
        """An unopened connection whose socket operations time out after `timeout` s each."""
        scheme, host, port, prefix = self._split()
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        return conn, prefix

    def headers(self, json_body: bool = False) -> dict:
        h = {"Accept": "application/json, text/event-stream"}
        if json_body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


class _Deadline:
    """Shuts a connection's socket down `seconds` after it is entered, so that every read or write
    blocked on it returns at once: a socket timeout is per operation and a server sending a byte at
    a time would never trip it. `expired` says whether it fired; leaving the block cancels it."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float):
        self.conn, self.seconds, self.expired = conn, seconds, False
        self.sock: Optional[socket.socket] = None
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.expired = True  # set before looking at the socket: see `opened`
        sock = self.sock if self.sock is not None else self.conn.sock
        if sock is not None:
            try:  # the plain socket's shutdown (an SSLSocket's own would drop its TLS state mid-read)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def opened(self) -> None:
        """Call right after the connection is opened. It keeps the socket: http.client drops
        `conn.sock` once a response that ends with the connection takes it over (HTTP/1.0, SSE),
        though the response still reads from it. And when the watchdog fired while the socket did
        not exist yet, nothing was shut down, so the deadline is enforced here."""
        self.sock = self.conn.sock
        if self.expired:
            raise socket.timeout("the request deadline passed while connecting")

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def _socket_timeout(deadline_s: float, idle_s: Optional[float]) -> float:
    # without an idle bound a single read may wait for the whole deadline (the watchdog ends it)
    return min(idle_s, deadline_s + 1.0) if idle_s is not None else deadline_s + 1.0


def _read_capped(resp: http.client.HTTPResponse, max_bytes: int) -> tuple[bytes, bool]:
    """The body, read in pieces; (at most max_bytes bytes, whether there was more)."""
    buf = bytearray()
    while True:
        piece = resp.read1(READ_SIZE)
        if not piece:
            return bytes(buf), False
        buf += piece
        if len(buf) > max_bytes:
            return bytes(buf[:max_bytes]), True


def _request(ep: Endpoint, method: str, path: str, body: Optional[dict], timeout: float,
             max_bytes: int) -> tuple[int, bytes]:
    conn, prefix = ep.connect(_socket_timeout(timeout, None))
    where = f"{ep.url}{path}"
    deadline = _Deadline(conn, timeout)
    try:
        with deadline:
            conn.connect()
            deadline.opened()
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, prefix + path, body=data, headers=ep.headers(json_body=body is not None))
            resp = conn.getresponse()
            cap = max_bytes if resp.status == 200 else ERROR_BODY_BYTES
            payload, more = _read_capped(resp, cap)
        if resp.status == 200 and more:
            raise ServerError(f"{where}: the answer exceeded {max_bytes} bytes; refused (a server's answer here is "
                              "far smaller)")
        return resp.status, payload
    except (OSError, http.client.HTTPException, ValueError) as e:
        if deadline.expired:
            raise ServerError(f"{where}: no complete answer within {timeout:g} s") from e
        raise ServerError(f"{where}: {type(e).__name__}: {e} (is the server running?)") from e
    finally:
        conn.close()


def fetch_text(ep: Endpoint, path: str, timeout: float = 30.0, max_bytes: int = MAX_JSON_BYTES) -> str:
    """GET `path`; the body as text (ServerError unless 200, or when it exceeds max_bytes)."""
    status, data = _request(ep, "GET", path, None, timeout, max_bytes)
    if status != 200:
        raise ServerError(f"{ep.url}{path}: HTTP {status}: {data[:300].decode(errors='replace')}")
    return data.decode("utf-8", errors="replace")


def request_json(ep: Endpoint, path: str, body: Optional[dict] = None, timeout: float = 30.0,
                 max_bytes: int = MAX_JSON_BYTES) -> Any:
    status, data = _request(ep, "GET" if body is None else "POST", path, body, timeout, max_bytes)
    if status != 200:
        raise ServerError(f"{ep.url}{path}: HTTP {status}: {data[:300].decode(errors='replace')}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ServerError(f"{ep.url}{path}: the answer is not JSON: {data[:200]!r}") from e


def fetch_metrics_text(ep: Endpoint, timeout: float = 30.0) -> str:
    """The server's Prometheus page, `GET /metrics` (at most MAX_METRICS_BYTES)."""
    return fetch_text(ep, "/metrics", timeout, MAX_METRICS_BYTES)


def list_models(ep: Endpoint, timeout: float = 30.0) -> list[str]:
    """Model ids served, from `GET /v1/models`."""
    obj = request_json(ep, "/v1/models", timeout=timeout)
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        raise ServerError(f"{ep.url}/v1/models: unexpected answer {str(obj)[:200]}")
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def server_version(ep: Endpoint, timeout: float = 10.0) -> Optional[str]:
    """`GET /version` (vLLM: {"version": ...}; SGLang has it too); None when it is not there."""
    try:
        obj = request_json(ep, "/version", timeout=timeout)
    except ServerError:
        return None
    if isinstance(obj, dict) and obj.get("version") is not None:
        return str(obj["version"])[:200]
    return None


def _chunk_text(obj: dict, chat: bool) -> str:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta")
        if not isinstance(delta, dict):
            return ""
        # reasoning models stream their thinking in a separate field; it is output all the same
        parts = [delta.get(k) for k in ("reasoning_content", "reasoning", "content")]
        return "".join(p for p in parts if isinstance(p, str))
    t = c.get("text")
    return t if isinstance(t, str) else ""


def _count(x: Any) -> Optional[int]:
    """A token count from the server's usage: a finite number >= 0, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return int(x)


def stream_request(ep: Endpoint, model: str, *, messages: Optional[list] = None,
                   prompt: Optional[Union[str, list[int]]] = None,
                   max_tokens: int, temperature: float = 0.0, ignore_eos: bool = False,
                   extra_body: Optional[dict] = None, timeout: Optional[float] = None,
                   idle_timeout: Optional[float] = None, max_reply_bytes: Optional[int] = None,
                   return_token_ids: bool = False) -> dict:
    """Send one streaming request and time it. Returns the per-request record (see the module
    docstring); a failure does not raise: the record has `ok: False` and `error`.
    `prompt` (completions): a string, or a list of token ids sent as they are.
    `return_token_ids`: ask for the prompt and output token ids (`prompt_token_ids`,
    `output_token_ids` of the record).

    `timeout`: the whole-request deadline in seconds (default `default_request_timeout(max_tokens)`);
    `idle_timeout`: fail when nothing arrives for this long (default: only the deadline);
    `max_reply_bytes`: the cap on the body read (default `default_max_reply_bytes(max_tokens)`)."""
    chat = messages is not None
    if chat == (prompt is not None):
        raise ValueError("give exactly one of messages (chat) or prompt (completions)")
    deadline_s = float(timeout) if timeout is not None else default_request_timeout(max_tokens)
    cap = int(max_reply_bytes) if max_reply_bytes is not None else default_max_reply_bytes(max_tokens)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": model, "max_tokens": int(max_tokens), "temperature": float(temperature),
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
    if ignore_eos:
        body["ignore_eos"] = True
    if return_token_ids:
        body["return_token_ids"] = True
    if extra_body:
        body.update(extra_body)
    rec: dict[str, Any] = {"ok": False, "error": None, "endpoint": path, "output_tokens": 0, "tokens_source": None,
                           "prompt_tokens": None, "ttft_s": None, "e2e_s": None, "itl_s": None, "chunks": 0,
                           "chunk_times_s": [], "finish_reason": None, "text": "", "reply_bytes": 0,
                           "prompt_token_ids": None, "output_token_ids": None}
    conn, prefix = ep.connect(_socket_timeout(deadline_s, idle_timeout))
    t0 = time.perf_counter()
    rec["t_start"] = time.time()
    rec["perf_start"] = t0  # time.perf_counter() at the send (for the caller's clock arithmetic)
    deadline = _Deadline(conn, deadline_s)
    try:
        with deadline:
            _stream(conn, prefix, path, body, ep, rec, chat, t0, deadline, idle_timeout, cap)
        return rec
    finally:
        conn.close()
        rec["duration_s"] = time.perf_counter() - t0


class _Failed(Exception):
    """Ends a stream early with the record's error message."""


def _token_ids(x: Any, field: str) -> list[int]:
    """A `token_ids` / `prompt_token_ids` value of an event: a list of ints >= 0 (else the request fails)."""
    if not isinstance(x, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x):
        raise _Failed(f"bad event: {field} is not a list of token ids: {str(x)[:100]}")
    return x


def _stream(conn, prefix: str, path: str, body: dict, ep: Endpoint, rec: dict, chat: bool, t0: float,
            deadline: _Deadline, idle_timeout: Optional[float], cap: int) -> None:
    text_parts: list[str] = []
    state: dict[str, Any] = {"usage": None, "done": False}

    def tokens_so_far() -> int:
        usage = state["usage"]
        n = _count(usage.get("completion_tokens")) if usage is not None else None
        return n if n is not None else len(rec["chunk_times_s"])

    def on_line(line: bytes, now: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # SSE comments (": keep-alive"), event names and blank separators
        payload = line[5:].strip()
        if payload == b"[DONE]":
            state["done"] = True
            return
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            raise _Failed(f"bad event: {payload[:200]!r}") from None
        if not isinstance(obj, dict):
            raise _Failed(f"bad event (not a JSON object): {payload[:200]!r}")
        if obj.get("error"):
            raise _Failed(f"server error in stream: {str(obj['error'])[:300]}")
        if isinstance(obj.get("usage"), dict):
            state["usage"] = obj["usage"]
        piece = _chunk_text(obj, chat)
        choices = obj.get("choices")
        if body.get("return_token_ids"):
            # vLLM: the prompt's ids in the first chunk (chat: top level; completions: in the choice),
            # the output's as each chunk's delta
            first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
            for src in (obj, first):
                if src.get("prompt_token_ids") is not None and rec["prompt_token_ids"] is None:
                    rec["prompt_token_ids"] = _token_ids(src["prompt_token_ids"], "prompt_token_ids")
            if first.get("token_ids") is not None:
                ids = _token_ids(first["token_ids"], "token_ids")
                if rec["output_token_ids"] is None:
                    rec["output_token_ids"] = []
                rec["output_token_ids"].extend(ids)
        if isinstance(choices, list) and choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
            rec["finish_reason"] = str(choices[0]["finish_reason"])[:100]
        if piece:
            text_parts.append(piece)
            rec["chunk_times_s"].append(now - t0)

    try:
        try:
            conn.connect()
            deadline.opened()
            conn.request("POST", prefix + path, body=json.dumps(body).encode(), headers=ep.headers(json_body=True))
            resp = conn.getresponse()
            if resp.status != 200:
                data, _ = _read_capped(resp, ERROR_BODY_BYTES)
                raise _Failed(f"HTTP {resp.status}: {data[:500].decode(errors='replace')}")
            buf = bytearray()
            scan = 0  # buf[:scan] has no newline
            while not state["done"]:
                data = resp.read1(READ_SIZE)
                now = time.perf_counter()
                if not data:
                    break
                rec["reply_bytes"] += len(data)
                if rec["reply_bytes"] > cap:
                    raise _Failed(f"reply exceeded {cap} bytes (--max-reply-bytes)")
                buf += data
                start = 0
                while not state["done"]:
                    nl = buf.find(b"\n", max(scan, start))
                    if nl < 0:
                        break
                    on_line(bytes(buf[start:nl]), now)
                    start = nl + 1
                del buf[:start]
                scan = len(buf)
            if not state["done"]:
                if deadline.expired:
                    raise _Failed(f"no complete reply within {deadline.seconds:g} s (--request-timeout)")
                cut = " (the last event was cut in the middle)" if bytes(buf).strip() else ""
                raise _Failed(f"stream ended before [DONE] after {tokens_so_far()} tokens{cut}")
        except (OSError, http.client.HTTPException, ValueError) as e:
            if deadline.expired:
                raise _Failed(f"no complete reply within {deadline.seconds:g} s (--request-timeout)") from None
            if isinstance(e, socket.timeout) and idle_timeout is not None:
                raise _Failed(f"the server sent nothing for {idle_timeout:g} s (--idle-timeout)") from None
            if isinstance(e, http.client.IncompleteRead) or (rec["reply_bytes"] and isinstance(e, ConnectionError)):
                raise _Failed(f"stream ended before [DONE] after {tokens_so_far()} tokens "
                              f"({type(e).__name__})") from None
            raise _Failed(f"{type(e).__name__}: {e}") from None
    except _Failed as f:
        rec["error"] = str(f)
        return
    rec["e2e_s"] = time.perf_counter() - t0
    times = rec["chunk_times_s"]
    rec["chunks"] = len(times)
    rec["text"] = "".join(text_parts)
    usage = state["usage"]
    n = _count(usage.get("completion_tokens")) if usage is not None else None
    if n is not None:
        rec["output_tokens"] = n
        rec["tokens_source"] = "usage"
        rec["prompt_tokens"] = _count(usage.get("prompt_tokens"))
    else:
        rec["output_tokens"] = len(times)
        rec["tokens_source"] = "chunks"
    if times:
        rec["ttft_s"] = times[0]
        if rec["output_tokens"] > 1:
            rec["itl_s"] = (times[-1] - times[0]) / (rec["output_tokens"] - 1)
    # A reply the server ended by a stop condition before any text (e.g. an EOS sampled first at
    # temperature > 0) is an answer, an empty one: ok, with no TTFT; a task scores it as wrong.
    empty_stop = not times and rec["finish_reason"] == "stop"
    if empty_stop and rec["tokens_source"] == "chunks":
        rec["output_tokens"] = 0
    rec["ok"] = (rec["output_tokens"] > 0 and bool(times)) or empty_stop
    if not rec["ok"]:
        rec["error"] = "the stream carried no output token"


def api_key_from_env() -> Optional[str]:
    return os.environ.get("OPENAI_API_KEY") or None

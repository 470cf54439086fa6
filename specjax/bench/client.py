"""HTTP side of the benchmark: an OpenAI-compatible streaming client on the standard library.

One request = one POST to `/v1/chat/completions` (messages) or `/v1/completions` (a prompt
string) with `stream: true` and `stream_options: {"include_usage": true}`. The client reads the
server-sent events line by line and stamps every chunk that carries text with `time.perf_counter()`,
so per request it knows:

* `ttft_s`: from just before the request is sent to the first chunk with text;
* `e2e_s`: to the end of the stream (`data: [DONE]` or the connection closing);
* `output_tokens`: the server's `usage.completion_tokens` (the final usage chunk), or, when the
  server sends no usage, the number of text chunks (`tokens_source` says which);
* `itl_s`: the mean inter-token latency after the first token, (t_last - t_first) / (tokens - 1)
  (vLLM's "TPOT"; with speculation several tokens share a chunk, so per-chunk gaps are not it);
* `chunk_times_s`: the arrival time of every text chunk (relative to the send).

No third-party HTTP library is used; each request opens its own connection (thread-safe, and on
localhost the cost is negligible next to a generation)."""
from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Endpoint", "ServerError", "request_json", "fetch_text", "fetch_metrics_text", "list_models",
           "server_version", "stream_request", "api_key_from_env"]


class ServerError(RuntimeError):
    """The server could not be reached, or answered with an error status."""


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


def _request(ep: Endpoint, method: str, path: str, body: Optional[dict], timeout: float) -> tuple[int, bytes]:
    conn, prefix = ep.connect(timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, prefix + path, body=data, headers=ep.headers(json_body=body is not None))
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise ServerError(f"{ep.url}{path}: {type(e).__name__}: {e} (is the server running?)") from e
    finally:
        conn.close()


def fetch_text(ep: Endpoint, path: str, timeout: float = 30.0) -> str:
    """GET `path`; the body as text (ServerError unless 200)."""
    status, data = _request(ep, "GET", path, None, timeout)
    if status != 200:
        raise ServerError(f"{ep.url}{path}: HTTP {status}: {data[:300].decode(errors='replace')}")
    return data.decode("utf-8", errors="replace")


def request_json(ep: Endpoint, path: str, body: Optional[dict] = None, timeout: float = 30.0) -> Any:
    status, data = _request(ep, "GET" if body is None else "POST", path, body, timeout)
    if status != 200:
        raise ServerError(f"{ep.url}{path}: HTTP {status}: {data[:300].decode(errors='replace')}")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ServerError(f"{ep.url}{path}: the answer is not JSON: {data[:200]!r}") from e


def fetch_metrics_text(ep: Endpoint, timeout: float = 30.0) -> str:
    """The server's Prometheus page, `GET /metrics`."""
    return fetch_text(ep, "/metrics", timeout)


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
        return str(obj["version"])
    return None


def _chunk_text(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        # reasoning models stream their thinking in a separate field; it is output all the same
        parts = [delta.get(k) for k in ("reasoning_content", "reasoning", "content")]
        return "".join(p for p in parts if isinstance(p, str))
    t = c.get("text")
    return t if isinstance(t, str) else ""


def stream_request(ep: Endpoint, model: str, *, messages: Optional[list] = None, prompt: Optional[str] = None,
                   max_tokens: int, temperature: float = 0.0, ignore_eos: bool = False,
                   extra_body: Optional[dict] = None, timeout: float = 600.0) -> dict:
    """Send one streaming request and time it. Returns the per-request record (see the module
    docstring); a failure does not raise: the record has `ok: False` and `error`."""
    chat = messages is not None
    if chat == (prompt is not None):
        raise ValueError("give exactly one of messages (chat) or prompt (completions)")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": model, "max_tokens": int(max_tokens), "temperature": float(temperature),
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    rec: dict[str, Any] = {"ok": False, "error": None, "endpoint": path, "output_tokens": 0, "tokens_source": None,
                           "prompt_tokens": None, "ttft_s": None, "e2e_s": None, "itl_s": None, "chunks": 0,
                           "chunk_times_s": [], "finish_reason": None, "text": ""}
    conn, prefix = ep.connect(timeout)
    t0 = time.perf_counter()
    rec["t_start"] = time.time()
    rec["perf_start"] = t0  # time.perf_counter() at the send (for the caller's clock arithmetic)
    try:
        return _stream(conn, prefix, path, body, ep, rec, chat, t0)
    finally:
        conn.close()
        rec["duration_s"] = time.perf_counter() - t0


def _stream(conn, prefix: str, path: str, body: dict, ep: Endpoint, rec: dict, chat: bool, t0: float) -> dict:
    text_parts: list[str] = []
    usage: Optional[dict] = None
    try:
        conn.request("POST", prefix + path, body=json.dumps(body).encode(), headers=ep.headers(json_body=True))
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}"
            return rec
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.perf_counter()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                rec["error"] = f"bad event: {payload[:200]!r}"
                return rec
            if isinstance(obj, dict) and obj.get("error"):
                rec["error"] = f"server error in stream: {str(obj['error'])[:300]}"
                return rec
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            piece = _chunk_text(obj, chat)
            choices = obj.get("choices") or []
            if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
                rec["finish_reason"] = choices[0]["finish_reason"]
            if piece:
                text_parts.append(piece)
                rec["chunk_times_s"].append(now - t0)
        rec["e2e_s"] = time.perf_counter() - t0
    except (OSError, socket.timeout, http.client.HTTPException) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    times = rec["chunk_times_s"]
    rec["chunks"] = len(times)
    rec["text"] = "".join(text_parts)
    if usage is not None and usage.get("completion_tokens") is not None:
        rec["output_tokens"] = int(usage["completion_tokens"])
        rec["tokens_source"] = "usage"
        if usage.get("prompt_tokens") is not None:
            rec["prompt_tokens"] = int(usage["prompt_tokens"])
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
    return rec


def api_key_from_env() -> Optional[str]:
    return os.environ.get("OPENAI_API_KEY") or None

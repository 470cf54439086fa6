"""A small client for OpenAI-compatible `/v1/chat/completions` endpoints (vLLM, SGLang, ...).

Standard library only (http.client + a thread pool). What leaves the machine is exactly the JSON
body {model, messages, max_tokens, temperature, top_p} plus the keys the user configured
(`extra_body`); the API key is read from an environment variable, sent only in the
Authorization header, and redacted from every log line and error message.

Retried (exponential backoff with jitter, `Retry-After` honoured): HTTP 5xx, 408, 429, timeouts,
connection errors, and unreadable 200 responses. Any other 4xx fails at once with the server's
message. Each request has a wall-clock deadline (`timeout_s`), enforced on connect and on every
read.
"""
from __future__ import annotations

import concurrent.futures as cf
import email.utils
import http.client
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence

from specjax.regen.common import LOGGER_NAME, Answer, Item, RegenerateError, Redactor, compose_answer, split_reasoning

__all__ = ["EndpointError", "ChatClient", "OpenAIBackend", "public_endpoint"]

log = logging.getLogger(LOGGER_NAME)

_MAX_ERROR_CHARS = 500
_RESERVED_BODY_KEYS = ("model", "messages")


class EndpointError(RegenerateError):
    """A request that failed for good (non-retryable status, or retries exhausted)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def public_endpoint(url: str) -> str:
    """The URL without user:password@ and query (what may be logged or stored)."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host = f"{host}:{p.port}"
    return urllib.parse.urlunsplit((p.scheme, host, p.path, "", ""))


def _completions_url(endpoint: str) -> urllib.parse.SplitResult:
    if not endpoint:
        raise RegenerateError("the openai back end needs an endpoint: --endpoint http://HOST:PORT/v1 (config: regenerate.endpoint)")
    p = urllib.parse.urlsplit(endpoint)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise RegenerateError(f"endpoint {public_endpoint(endpoint)!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000/v1")
    path = p.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return p._replace(path=path)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # HTTP-date form
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _server_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            text = str(err.get("message") or err)
        elif isinstance(err, str):
            text = err
    except (json.JSONDecodeError, AttributeError):
        pass
    return text[:_MAX_ERROR_CHARS]


class ChatClient:
    """Thread-safe: every request opens its own connection."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
        extra_body: dict | None = None,
        redactor: Redactor | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not model:
            raise RegenerateError("the openai back end needs a model name: --model NAME (config: regenerate.model), "
                                  "as the server lists it under /v1/models")
        if timeout_s <= 0:
            raise RegenerateError(f"timeout must be positive, got {timeout_s}")
        if max_retries < 0:
            raise RegenerateError(f"max_retries must be >= 0, got {max_retries}")
        extra_body = dict(extra_body or {})
        bad = [k for k in _RESERVED_BODY_KEYS if k in extra_body]
        if bad:
            raise RegenerateError(f"extra body keys {bad} are set by specjax itself; remove them from --extra-body")
        self.url = _completions_url(endpoint)
        self.model = model
        self.api_key = os.environ.get(api_key_env) or None
        self.api_key_env = api_key_env
        self.redactor = redactor or Redactor(self.api_key)
        if self.api_key and self.api_key not in self.redactor.secrets:
            self.redactor = Redactor(self.api_key, *self.redactor.secrets)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.extra_body = extra_body
        self._sleep = sleep
        self._rng = random.Random()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ one HTTP exchange
    def body(self, messages: Sequence[dict], *, max_tokens: int, temperature: float, top_p: float) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
        }
        body.update(self.extra_body)
        return body

    def _post_once(self, payload: bytes) -> dict:
        deadline = time.monotonic() + self.timeout_s

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Retryable(f"no complete response within the {self.timeout_s:g} s timeout")
            return left

        u = self.url
        conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(u.hostname, u.port, timeout=remaining())
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            try:
                conn.request("POST", u.path or "/", body=payload, headers=headers)
                sock = conn.sock  # the response may detach it from conn; the timeout is the socket's
                sock.settimeout(remaining())
                resp = conn.getresponse()
                chunks = []
                while not resp.isclosed():  # http.client closes the response once the body is read
                    left = remaining()
                    try:
                        sock.settimeout(left)
                    except OSError:  # already closed by the response
                        pass
                    chunk = resp.read(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                data = b"".join(chunks)
            except (socket.timeout, TimeoutError):
                raise _Retryable(f"no complete response within the {self.timeout_s:g} s timeout") from None
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                raise _Retryable(self.redactor.redact(f"connection error: {type(e).__name__}: {e}")) from None
        finally:
            conn.close()
        status = resp.status
        if status == 200:
            try:
                return json.loads(data)
            except json.JSONDecodeError:
                raise _Retryable(f"HTTP 200 with a body that is not JSON ({len(data)} bytes)") from None
        # redacted here, at the source: no exception object (whose text a traceback or a logging
        # error report could print) ever holds the key a server echoed back
        msg = self.redactor.redact(f"HTTP {status}: {_server_message(data)}")
        if status >= 500 or status in (408, 429):
            raise _Retryable(msg, _retry_after(resp.getheader("Retry-After")))
        raise EndpointError(
            f"{public_endpoint(u.geturl())} refused the request ({self.redactor.redact(msg)}); "
            + ("check the API key in $" + self.api_key_env if status in (401, 403) else
               "check --model and the sampling settings" if status in (400, 404, 422) else "not retried"),
            status,
        )

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        base = min(self.backoff_max_s, self.backoff_base_s * (2 ** attempt))
        with self._lock:
            jitter = self._rng.uniform(0.0, base * 0.5)
        delay = base + jitter
        if retry_after is not None:  # the server knows best when it can take the request again
            delay = max(retry_after, min(delay, self.backoff_base_s))
        return delay

    def chat(self, messages: Sequence[dict], *, max_tokens: int, temperature: float, top_p: float,
             what: str = "request") -> dict:
        """POST one chat completion with retries; returns the decoded JSON response."""
        payload = json.dumps(self.body(messages, max_tokens=max_tokens, temperature=temperature,
                                       top_p=top_p)).encode("utf-8")
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                return self._post_once(payload)
            except _Retryable as e:
                last = self.redactor.redact(e)
                if attempt == self.max_retries:
                    break
                delay = self._delay(attempt, e.retry_after)
                log.warning("%s: attempt %d/%d failed (%s); retrying in %.2f s", what, attempt + 1,
                            self.max_retries + 1, last, delay)
                self._sleep(delay)
        raise EndpointError(
            f"{what}: gave up after {self.max_retries + 1} attempts to {public_endpoint(self.url.geturl())}; "
            f"last error: {last}. Check that the server is up and not overloaded, or raise "
            "--max-retries / --timeout"
        )


def parse_choice(resp: dict) -> tuple[str, str | None, str | None, int]:
    """(content, reasoning, finish_reason, completion_tokens) of the first choice."""
    try:
        choice = resp["choices"][0]
        msg = choice.get("message") or {}
    except (KeyError, IndexError, TypeError):
        raise RegenerateError(f"response without choices[0].message: {str(resp)[:_MAX_ERROR_CHARS]}") from None
    content = msg.get("content") or ""
    # vLLM / SGLang reasoning parsers: `reasoning_content` (newer vLLM also `reasoning`)
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")
    usage = resp.get("usage") or {}
    tokens = usage.get("completion_tokens")
    return content, reasoning, choice.get("finish_reason"), int(tokens) if isinstance(tokens, int) else 0


class OpenAIBackend:
    """Answers items through a `ChatClient` with ``concurrency`` requests in flight."""

    name = "openai"

    def __init__(self, client: ChatClient, *, max_new_tokens: int, temperature: float, top_p: float,
                 keep_reasoning: bool, concurrency: int = 8):
        if concurrency < 1:
            raise RegenerateError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.keep_reasoning = keep_reasoning
        self.concurrency = concurrency

    def _one(self, item: Item) -> Answer:
        resp = self.client.chat(item.prompt, max_tokens=self.max_new_tokens, temperature=self.temperature,
                                top_p=self.top_p, what=f"row {item.source_index}")
        content, reasoning, finish, tokens = parse_choice(resp)
        reasoning, answer = split_reasoning(content, reasoning)
        if not answer:
            return Answer(None, "empty answer", tokens, finish == "length")
        return Answer(compose_answer(reasoning, answer, self.keep_reasoning), None, tokens, finish == "length")

    def answer(self, items: Sequence[Item]) -> list[Answer]:
        if not items:
            return []
        with cf.ThreadPoolExecutor(max_workers=min(self.concurrency, len(items)),
                                   thread_name_prefix="regen-http") as pool:
            futures = [pool.submit(self._one, it) for it in items]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:  # fail fast: drop what has not started
                    f.cancel()
                raise

"""Shared pieces of the regeneration stage: errors, work items, reasoning handling, key redaction."""
from __future__ import annotations

import dataclasses
import logging
import re

from specjax.data.chat import REASONING_CLOSE, REASONING_OPEN

__all__ = [
    "RegenerateError", "ManifestMismatch", "Item", "Answer", "prompt_messages", "split_reasoning",
    "compose_answer", "Redactor", "LOGGER_NAME",
]

# Every regeneration module logs through this one logger, so one filter redacts all of them.
LOGGER_NAME = "specjax.regen"


class RegenerateError(RuntimeError):
    """A regeneration problem the user can fix; the message says what and how."""


class ManifestMismatch(RegenerateError):
    """`--resume` into a directory written with other settings."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One conversation to answer: the prompt turns (trailing assistant turns removed)."""
    source_index: int
    prompt: tuple  # tuple of {"role", "content"} dicts


@dataclasses.dataclass(frozen=True)
class Answer:
    """A back end's result for one item: the new assistant content, or the reason it was skipped."""
    content: str | None
    skip_reason: str | None = None
    new_tokens: int = 0
    truncated: bool = False  # stopped by max_new_tokens rather than end of turn
    prompt: tuple | None = None  # the turns actually sent, when older turns were dropped to fit (else None)


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """The conversation minus every trailing assistant turn, or None when what is left does not
    end with a turn to answer (a user or tool message) or holds no user turn at all."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:end]]
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        return None
    if not any(m["role"] == "user" for m in prompt):
        return None
    if prompt[-1]["role"] == "user" and not prompt[-1]["content"].strip():
        return None
    return prompt


_THINK_BLOCK = re.compile(re.escape(REASONING_OPEN) + r"(.*?)" + re.escape(REASONING_CLOSE), re.S)


def split_reasoning(text: str, reasoning: str | None = None) -> tuple[str | None, str]:
    """(reasoning, answer) from a generated text. Reasoning may come separately (the
    `reasoning_content` field of vLLM / SGLang responses) or inline as `<think>...</think>`; a
    closing tag without an opening one means the prompt opened the block (DeepSeek-R1 style).
    An unclosed `<think>` (generation stopped while reasoning) makes the whole rest reasoning."""
    parts = [reasoning.strip()] if reasoning and reasoning.strip() else []
    answer = text or ""
    head, sep, tail = answer.partition(REASONING_CLOSE)
    if sep and REASONING_OPEN not in head:
        if head.strip():
            parts.append(head.strip())
        answer = tail
    found = _THINK_BLOCK.findall(answer)
    parts.extend(t.strip() for t in found if t.strip())
    answer = _THINK_BLOCK.sub("", answer)
    if REASONING_OPEN in answer:  # unclosed block
        answer, _, rest = answer.partition(REASONING_OPEN)
        if rest.strip():
            parts.append(rest.strip())
    had_reasoning = bool(parts) or bool(found) or bool(sep) or reasoning is not None
    return ("\n\n".join(parts) if had_reasoning else None), answer.strip()


def compose_answer(reasoning: str | None, answer: str, keep_reasoning: bool) -> str:
    """The stored assistant content: with reasoning kept, a `<think>\\n...\\n</think>\\n\\n` prefix
    (the Qwen3 convention, which its chat template splits back out); otherwise the answer only."""
    if keep_reasoning and reasoning:
        return f"{REASONING_OPEN}\n{reasoning}\n{REASONING_CLOSE}\n\n{answer}"
    return answer


class Redactor(logging.Filter):
    """Replaces secrets (the API key) by `[REDACTED]` in strings and in log records.

    Installed on the regeneration logger for the duration of a run; every error message the
    client builds goes through `.redact` too."""

    MARK = "[REDACTED]"

    def __init__(self, *secrets: str | None):
        super().__init__()
        # very short "secrets" would redact ordinary words; a real key is long
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def redact(self, text) -> str:
        text = str(text)
        for s in self.secrets:
            text = text.replace(s, self.MARK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            msg = record.getMessage()
            clean = self.redact(msg)
            if clean != msg:
                record.msg, record.args = clean, None
            if record.exc_info and record.exc_info[1] is not None:
                # the formatted traceback would repeat the exception text; keep only the clean line
                record.msg = f"{record.msg} ({self.redact(record.exc_info[1])})"
                record.exc_info, record.exc_text = None, None
        return True

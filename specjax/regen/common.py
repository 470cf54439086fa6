"""Shared pieces of the regeneration stage: errors, work items, reasoning handling, key redaction."""
from __future__ import annotations

import dataclasses
import logging
import re

from specjax.data.chat import REASONING_CLOSE, REASONING_OPEN

__all__ = [
    "RegenerateError", "ManifestMismatch", "Item", "Answer", "prompt_messages", "split_reasoning",
    "compose_answer", "Redactor", "LOGGER_NAME", "answer_rounds", "Conversation", "answer_every_turn",
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


def answer_rounds(prompt) -> list[list[dict]]:
    """The prompt (``prompt_messages``' output) as rounds for answering every turn: each round is the
    new non-assistant messages up to a turn the target answers, i.e. a user or tool message that
    an assistant message followed in the source, or the last one. Every assistant message of the
    source is dropped: the target's own answers take their places."""
    rounds: list[list[dict]] = []
    cur: list[dict] = []
    for j, m in enumerate(prompt):
        if m["role"] == "assistant":
            continue
        cur.append(m)
        nxt = prompt[j + 1]["role"] if j + 1 < len(prompt) else None
        if m["role"] in ("user", "tool") and nxt in (None, "assistant"):
            rounds.append(cur)
            cur = []
    return rounds


@dataclasses.dataclass
class Conversation:
    """Every turn of one conversation answered in order (`answer_every_turn`)."""
    messages: list | None  # the conversation with the target's answers; None when its first turn failed
    skip_reason: str | None = None  # why the first turn failed
    turns: int = 0  # assistant turns answered
    rounds: int = 0  # turns the source asks for
    cut_reason: str | None = None  # why a later turn was not answered (the conversation ends before it)
    new_tokens: int = 0
    truncated: int = 0  # answers stopped by max_new_tokens (kept)
    shortened: bool = False  # older turns were dropped to fit a prompt
    # finished windows: the conversation as it stood (ending with the target's answer) each time a
    # later prompt had to drop older turns to fit; each is a training row of its own, so no answer
    # the target gave is lost (the turns kept in the shortened prompt appear in both rows)
    windows: list = dataclasses.field(default_factory=list)

    def rows(self) -> list:
        """The training rows of this conversation: its finished windows, then the last one."""
        return [*self.windows, self.messages] if self.messages is not None else []


class ConversationFlow:
    """One conversation answered turn by turn: ``next_item()`` is the prompt of its next turn (None
    once it has ended), ``record(item, answer)`` takes the back end's answer to it, ``conversation``
    is the result.

    all_turns: every turn in order (``answer_rounds``), each after the target's own earlier answers;
    else only the last turn, after the source's earlier turns (its earlier answers included). A
    turn that cannot be answered ends the conversation there (``cut_reason``; the first turn:
    ``skip_reason``). When a back end drops older turns to fit (``Answer.prompt``), the
    conversation continues from what the target saw, and what it held before is kept as a finished
    window (``Conversation.windows``)."""

    def __init__(self, item: Item, all_turns: bool = True):
        self.source_index = item.source_index
        self.rounds = answer_rounds(item.prompt) if all_turns else [list(item.prompt)]
        self.conversation = Conversation(messages=None, rounds=len(self.rounds))
        if not self.rounds:
            self.conversation.skip_reason = "no user turn to answer"
        self._state: list[dict] = []
        self._turn = 0
        self._ended = not self.rounds

    @property
    def turn(self) -> int:
        """Index of the turn ``next_item`` asks for."""
        return self._turn

    def next_item(self) -> Item | None:
        if self._ended:
            return None
        return Item(self.source_index, tuple(self._state + self.rounds[self._turn]))

    def record(self, item: Item, ans: Answer) -> None:
        c = self.conversation
        c.new_tokens += ans.new_tokens
        if ans.content is None:
            if self._turn == 0:
                c.skip_reason = ans.skip_reason or "no answer"
            else:
                c.cut_reason = ans.skip_reason or "no answer"
            self._ended = True
            return
        c.truncated += int(ans.truncated)
        c.shortened |= ans.prompt is not None
        if ans.prompt is not None and self._state:
            c.windows.append(self._state)
        self._state = list(ans.prompt if ans.prompt is not None else item.prompt) + [
            {"role": "assistant", "content": ans.content}]
        c.messages, c.turns = self._state, c.turns + 1
        self._turn += 1
        self._ended = self._turn >= len(self.rounds)


def answer_every_turn(answer, items, all_turns: bool = True) -> list[Conversation]:
    """Answer every turn of each item's conversation (``ConversationFlow``) in rounds: round r sends,
    for every conversation that has an r-th turn, its conversation so far in one ``answer(items)``
    call, so a batched back end batches across conversations. ``all_turns=False``: the last turn
    only (one round)."""
    flows = [ConversationFlow(it, all_turns) for it in items]
    live = [f for f in flows if f.next_item() is not None]
    while live:
        asked = [f.next_item() for f in live]
        answers = answer(asked)
        if len(answers) != len(asked):
            raise RuntimeError(f"the back end returned {len(answers)} answers for {len(asked)} prompts")
        for f, it, ans in zip(live, asked, answers):
            f.record(it, ans)
        live = [f for f in live if f.next_item() is not None]
    return [f.conversation for f in flows]


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

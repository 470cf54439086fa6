r"""Chat-template a conversation and mark the assistant tokens (the draft is trained only there).

How the assistant spans are found: for assistant turn i, render ``messages[:i]`` with the
generation prompt and ``messages[:i+1]`` without it. When the first is a prefix of the second and
the second a prefix of the full rendering, the characters in between are what the template emits
for that turn; the span runs from there to the end of the first special token after the content
(the end-of-turn marker), so the newline or trailer a template puts after the marker, which the
model never generates, is not trained on. Some templates break the prefix property (they render
history differently from the last turn); for those turns we fall back to locating the content
string in the full text and extending the span over a special token that follows it.

Two optional masks (config `data.mask_reasoning_content`, `data.mask_generation_prompt`; the idea
is from the NeMo AutoModel README) narrow the spans further:
- reasoning: every rendered `<think>...</think>` block inside an assistant span (and the line breaks
  after it) leaves the loss; a `</think>` with no opening tag in the span (templates whose
  generation prompt already opened the block) masks from the span start to it.
- generation prompt: the span of a turn starts after the longest generation prompt the template
  can supply at inference (its default one, or the `enable_thinking=False` one, which for Qwen3 is
  the role header plus an empty `<think>\n\n</think>\n\n` block). Only when that prompt extends
  the unchanged rendering of the conversation so far and the full rendering reproduces it in full;
  otherwise the turn stays supervised as without the flag.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

__all__ = [
    "Example", "SkipRow", "ChatTemplateUnusable", "tokenize_conversation", "resolve_chat_template",
    "render_chat", "check_chat_template", "template_source", "CHAT_TEMPLATE_HINT", "REASONING_OPEN", "REASONING_CLOSE",
]

# The reasoning-trace convention of Qwen3 / DeepSeek-R1 / vLLM reasoning parsers.
REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"
# Template variables that select a non-thinking generation prompt (Qwen3's name for it).
_NO_THINKING_KWARGS = ({"enable_thinking": False},)

CHAT_TEMPLATE_HINT = (
    "set one with the config key `data.chat_template` (a Jinja template string or a path to a "
    ".jinja file), e.g. the template of the instruct model the target was tuned as"
)


class ChatTemplateUnusable(ValueError):
    """The chat template cannot be rendered for any row: a missing package (jinja2), a template that
    does not compile, a tokenizer that cannot apply it. A property of the machine or the config, not
    of a row, so it stops the run at its first occurrence instead of being counted as a skip."""


_JINJA_FIX = (
    "transformers renders chat templates with jinja2, which is not installed in this environment; "
    "install it (`pip install 'jinja2>=3.1'`, or reinstall specjax, which depends on it) and run again"
)


def _environment_problem(e: BaseException) -> ChatTemplateUnusable | None:
    """The ChatTemplateUnusable for an exception from rendering, or None when it is a row's problem
    (e.g. a template's raise_exception() for roles that do not alternate)."""
    if isinstance(e, ImportError):  # transformers raises it when jinja2 is missing
        return ChatTemplateUnusable(f"the chat template cannot be rendered: {e}. Fix: {_JINJA_FIX}.")
    try:
        from jinja2.exceptions import TemplateSyntaxError
    except ImportError:  # pragma: no cover - jinja2 missing is caught above
        return None
    if isinstance(e, TemplateSyntaxError):
        return ChatTemplateUnusable(
            f"the chat template does not compile (line {e.lineno}: {e.message}); fix it or "
            f"{CHAT_TEMPLATE_HINT}.")
    return None


def render_chat(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    """`apply_chat_template` to text. Raises ChatTemplateUnusable when the template cannot be rendered
    at all (see there); any other exception is the row's and propagates unchanged."""
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - classified, then re-raised
        env = _environment_problem(e)
        if env is not None:
            raise env from e
        raise
    if not isinstance(text, str):  # defensive: some versions return a list for batched input
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


_PROBE = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}]


def check_chat_template(tokenizer=None, template: str | None = None) -> None:
    """Before any expensive stage: jinja2 importable, and (with a tokenizer) the template renders a
    two-turn probe conversation. Raises ChatTemplateUnusable naming the cause and the fix. A template
    that rejects the probe for a row-like reason (e.g. it requires a system turn) passes: rows are
    judged one by one later."""
    try:
        import jinja2  # noqa: F401
    except ImportError as e:
        raise ChatTemplateUnusable(f"cannot import jinja2 ({e}). Fix: {_JINJA_FIX}.") from None
    if tokenizer is None:
        return
    tmpl = resolve_chat_template(tokenizer, template)
    try:
        render_chat(tokenizer, tmpl, _PROBE, add_generation_prompt=False)
    except ChatTemplateUnusable as e:
        raise ChatTemplateUnusable(f"{template_source(tokenizer, template)}: {e}") from e
    except Exception:  # noqa: BLE001 - the probe's own problem, not the environment's
        pass


def template_source(tokenizer, chat_template: str | None = None) -> str:
    """Where the template comes from, for messages: the file or config key, or the tokenizer's folder."""
    if chat_template:
        if "{" not in chat_template and os.path.isfile(chat_template):
            return f"the chat template file {chat_template}"
        return "the chat template given inline in data.chat_template"
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return f"the tokenizer's chat template ({where})"


class SkipRow(Exception):
    """This conversation cannot become a training example. ``reason`` is a short category
    (used as a counter key); ``detail`` says more for logs."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason + (f": {detail}" if detail else ""))
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # int32 [n], 1 on assistant tokens
    source: str = ""  # file the row came from (for error reports)
    row: int = -1  # N of the row's location `source:N`, from 1 (the JSONL line, the JSON / parquet row)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def resolve_chat_template(tokenizer, chat_template: str | None = None) -> str:
    """The template to use: an explicit string (or path to a file holding one), else the
    tokenizer's own. No template at all is a configuration error, not a bad row."""
    if chat_template:
        if "{" not in chat_template and os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return f.read()
        return chat_template
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # some tokenizers carry several named templates
        tmpl = tmpl.get("default") or next(iter(tmpl.values()), None)
    if not tmpl:
        raise ValueError(f"the tokenizer has no chat template; {CHAT_TEMPLATE_HINT}")
    return tmpl


_render = render_chat


def _special_strings(tokenizer) -> list[str]:
    """Special-token strings, longest first (so '<|im_end|>' wins over a shorter overlap)."""
    found = set()
    for t in getattr(tokenizer, "all_special_tokens", None) or []:
        found.add(str(t))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        if getattr(tok, "special", False):
            found.add(str(getattr(tok, "content", tok)))
    return sorted((s for s in found if s), key=len, reverse=True)


def _first_marker_end(text: str, start: int, stop: int, specials: list[str]) -> int | None:
    """End of the earliest special token in text[start:stop] (longest on ties), or None."""
    best = None
    for s in specials:
        pos = text.find(s, start, stop)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, pos + len(s))  # specials are longest-first, so ties keep the longest
    return None if best is None else best[1]


def _generation_prompt_end(tokenizer, template: str, history: list[dict], full: str) -> int | None:
    """End (in ``full``) of the longest generation prompt the template supplies after ``history``
    that the full rendering reproduces in full, or None when no variant qualifies.

    A variant qualifies only when it is the unchanged rendering of ``history`` plus a non-empty
    suffix; the variants are the default prompt and the non-thinking one (Qwen3 appends an empty
    reasoning block there), since either may be what a server sends at inference."""
    try:
        base = _render(tokenizer, template, history, add_generation_prompt=False)
    except Exception:  # a template that rejects this history
        return None
    if not full.startswith(base):
        return None
    best = None
    for kwargs in ({},) + _NO_THINKING_KWARGS:
        try:
            prompt = _render(tokenizer, template, history, add_generation_prompt=True, **kwargs)
        except Exception:
            continue
        if len(prompt) > len(base) and prompt.startswith(base) and full.startswith(prompt):
            best = len(prompt) if best is None else max(best, len(prompt))
    return best


def _assistant_spans(
    tokenizer, template: str, messages: list[dict], full: str, mask_generation_prompt: bool = False
) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    cursor = 0  # spans are found left to right and must not overlap
    specials = _special_strings(tokenizer)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content = m["content"].strip()
        span = None
        try:
            start_text = _render(tokenizer, template, messages[:i], add_generation_prompt=True)
            end_text = _render(tokenizer, template, messages[: i + 1], add_generation_prompt=False)
        except Exception:  # e.g. a template that rejects an empty or assistant-first history
            start_text = end_text = None
        if (
            end_text is not None
            and end_text.startswith(start_text)
            and full.startswith(end_text)
            and len(start_text) >= cursor
        ):
            s0, s1 = len(start_text), len(end_text)
            # The turn ends with the first special token after the content (the end-of-turn
            # marker). Anything after it -- a newline, or a trailer a template appends only after
            # the last message -- is glue the model never generates (serving stops at the marker).
            cpos = full.find(content, s0, s1)
            end = _first_marker_end(full, cpos + len(content), s1, specials) if cpos >= 0 else None
            if end is None:  # no marker (or content rewritten by the template): whole turn text
                end = s0 + len(full[s0:s1].rstrip())
            if mask_generation_prompt:
                g = _generation_prompt_end(tokenizer, template, messages[:i], full)
                if g is not None and s0 <= g < end:
                    s0 = g
            if end > s0:
                span = (s0, end)
        if span is None:
            # Templates that re-render reasoning (Qwen3 drops it from earlier turns) keep only the
            # answer after the closing tag, so look for that too.
            candidates = [content]
            if REASONING_CLOSE in content:
                candidates.append(content.split(REASONING_CLOSE)[-1].strip())
            idx, found = -1, ""
            for c in candidates:
                if c:
                    idx = full.find(c, cursor)
                    if idx >= 0:
                        found = c
                        break
            if idx < 0:
                raise SkipRow("assistant turn not found in templated text", f"turn {i}")
            end = idx + len(found)
            # Take the end-of-turn marker too when it follows the content (whitespace allowed).
            at = end
            while at < len(full) and full[at].isspace():
                at += 1
            for s in specials:  # longest first
                if full.startswith(s, at):
                    end = at + len(s)
                    break
            span = (idx, end)
        spans.append(span)
        cursor = span[1]
    return spans


def _reasoning_ranges(full: str, s: int, e: int) -> list[tuple[int, int]]:
    """Character ranges of rendered reasoning blocks inside the span [s, e): `<think>...</think>`
    plus the line breaks after it (the answer's first token never starts with a line break in
    byte-level BPE pre-tokenizers, so no answer token is lost). An unclosed block runs to the end
    of the span; a closing tag with no opening one masks from the current position (templates
    whose generation prompt opened the block, e.g. DeepSeek-R1's)."""
    out = []
    pos = s
    while pos < e:
        o = full.find(REASONING_OPEN, pos, e)
        c = full.find(REASONING_CLOSE, pos, e)
        if o < 0 and c < 0:
            break
        if c < 0:  # opened, never closed (the answer ran out of tokens while reasoning)
            out.append((o, e))
            break
        a = o if 0 <= o < c else pos
        b = c + len(REASONING_CLOSE)
        while b < e and full[b] in "\r\n":
            b += 1
        out.append((a, b))
        pos = b
    return out


def _raise_if_unencodable(messages: list[dict], full: str) -> None:
    """SkipRow("invalid Unicode") naming the turn (or the templated text) that holds text no tokenizer
    can encode. The readers already skip such rows; this covers messages passed in directly."""
    from specjax.data.sources import unencodable

    for i, m in enumerate(messages):
        bad = unencodable(m["content"])
        if bad is not None:
            raise SkipRow("invalid Unicode", f"turn {i} content has {bad}")
    bad = unencodable(full)
    if bad is not None:
        raise SkipRow("invalid Unicode", f"the templated text has {bad}")


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    seq_length: int,
    truncate: bool = True,
    chat_template: str | None = None,
    *,
    mask_reasoning_content: bool = False,
    mask_generation_prompt: bool = False,
) -> Example:
    """Template + tokenize one conversation; loss_mask marks the assistant tokens (minus reasoning
    blocks with ``mask_reasoning_content``, minus the generation prompt's part of each turn with
    ``mask_generation_prompt``; see the module docstring).

    Raises SkipRow for a conversation that cannot be used, ValueError for a tokenizer that
    cannot do the job (no chat template, no offsets), ChatTemplateUnusable (a ValueError) when the
    template cannot be rendered at all (jinja2 missing, a syntax error)."""
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    template = resolve_chat_template(tokenizer, chat_template)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipRow("no assistant turn")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise SkipRow("empty assistant content", f"turn {i}")

    try:
        full = _render(tokenizer, template, messages, add_generation_prompt=False)
    except ChatTemplateUnusable:
        raise  # the machine's or the config's problem: stop at the first row, not 3000 skips
    except Exception as e:  # raise_exception() in templates, e.g. roles that do not alternate
        raise SkipRow("chat template error", f"{type(e).__name__}: {e}") from None
    if not full.strip():
        raise SkipRow("empty after templating")

    spans = _assistant_spans(tokenizer, template, messages, full, mask_generation_prompt)
    keep = np.zeros(len(full) + 1, dtype=bool)  # per character: inside a supervised span
    for s, e in spans:
        keep[s:e] = True
    if mask_reasoning_content:
        for s, e in spans:
            for a, b in _reasoning_ranges(full, s, e):
                keep[a:b] = False

    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:
        raise ValueError(
            "the tokenizer cannot return character offsets; load a fast tokenizer "
            "(AutoTokenizer.from_pretrained(..., use_fast=True))"
        ) from e
    except TypeError:  # tokenizers' "TextEncodeInput must be ..." for text with a lone surrogate
        _raise_if_unencodable(messages, full)
        raise
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    if ids.size == 0:
        raise SkipRow("empty after templating")
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    # A token belongs to a span when it starts inside it (a token never straddles a special
    # token, and the content boundary is normally a pre-tokenizer split point).
    starts = np.clip(offsets[:, 0], 0, len(full))
    mask = keep[starts]
    if not mask.any():
        if mask_reasoning_content and spans:
            raise SkipRow("no assistant token outside reasoning")
        raise SkipRow("no assistant token")

    if ids.shape[0] > seq_length:
        if not truncate:
            raise SkipRow("longer than seq_length", f"{ids.shape[0]} > {seq_length} tokens")
        ids, mask = ids[:seq_length], mask[:seq_length]
        if not mask.any():
            raise SkipRow("no assistant token after truncation")

    return Example(
        input_ids=ids.astype(np.int32),
        loss_mask=mask.astype(np.int32),
    )

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

Rendering (`render_chat`, used by every caller: tokenize_conversation here and in the
data.prepare_workers processes, the preflight `check_chat_template`, regeneration's and eval's prompt
rendering) gives the text transformers' ``apply_chat_template`` gives, but under a time and size limit
(`TemplateLimits`: config `data.template_time_limit_s`, `data.max_template_chars`; see "Bounded
rendering" below). A rendering past one raises ChatTemplateLimitExceeded naming the template (its file,
the inline config value, or the tokenizer's folder) and the limit: the run stops, since the template
would do the same on every row.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import os
import re
import time
import types
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Example", "SkipRow", "ChatTemplateUnusable", "ChatTemplateLimitExceeded", "ChatTemplateText", "TemplateLimits",
    "tokenize_conversation", "resolve_chat_template", "render_chat", "check_chat_template", "template_source",
    "CHAT_TEMPLATE_HINT", "REASONING_OPEN", "REASONING_CLOSE", "DEFAULT_TEMPLATE_TIME_LIMIT_S",
    "DEFAULT_MAX_TEMPLATE_CHARS",
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


# ---------------------------------------------------------------------------------------------
# Bounded rendering. Chat templates come with the model (or the config) and run for every row,
# several times per row. Jinja's sandbox stops a template from reaching Python's internals and caps
# one range() at 100,000 items, but a template can still loop 10^10 times (nested ranges: it hung
# with nothing logged) or build a 6 GB string in one step ('x' * 6 * 10**9: 5 GB in 9 s). So every
# render here runs under `TemplateLimits`, in an environment that keeps transformers' rendering
# semantics (its environment options, globals and tojson filter: the output is byte-identical,
# tests/data/test_template_limits.py) and adds checks:
# - time: the deadline is checked at every loop iteration, call, filter, operator and output piece;
# - size: every value the template builds (a string, counted in characters; a list, dict or tuple,
#   8 characters per item) and the text it produces (counted as it is produced, buffered blocks and
#   macro bodies included) must stay within `max_chars`. The operations whose result can be much
#   larger than their inputs by a number written in the template -- `*`, `**`, `%` and format
#   widths, center/ljust/rjust/zfill/expandtabs, join, replace, split, indent, tojson's indent,
#   batch/slice counts, lipsum, turning a string into a list, converting a container to text -- are
#   checked before they run, the rest right after, so a template holds at most a few times the limit.

DEFAULT_TEMPLATE_TIME_LIMIT_S = 10.0
DEFAULT_MAX_TEMPLATE_CHARS = 64 * 2**20
_ITEM_CHARS = 8  # what one item of a list, tuple or dict counts for (a pointer)
_MAX_INT_BITS = 1 << 16  # far beyond any count, index or date a template computes


class TemplateLimits(NamedTuple):
    """Bounds of one rendering of a chat template (config `data.template_time_limit_s`,
    `data.max_template_chars`); see the comment above `DEFAULT_TEMPLATE_TIME_LIMIT_S`. A real template
    renders a conversation in milliseconds, and a row within `data.max_row_bytes` (16 MiB) renders
    to about as many characters as it holds, so neither limit is near real use."""

    time_s: float = DEFAULT_TEMPLATE_TIME_LIMIT_S
    max_chars: int = DEFAULT_MAX_TEMPLATE_CHARS

    @classmethod
    def of(cls, data) -> "TemplateLimits":
        """The bounds a config's `data` section sets (`data.template_time_limit_s`, `data.max_template_chars`)."""
        return cls(data.template_time_limit_s, data.max_template_chars)


class ChatTemplateLimitExceeded(ChatTemplateUnusable):
    """A rendering ran past a `TemplateLimits` bound. The message names the template, the limit and
    its config key. Like every ChatTemplateUnusable it stops the run at once: a template that loops or
    explodes does so for every row (thousands of skips, each costing the full time limit), and the
    limits sit far above what any row within `data.max_row_bytes` needs with a real template."""


class ChatTemplateText(str):
    """A chat template's text (a plain ``str`` for every use) that also carries where it came from
    (``source``, for messages, see `template_source`), the ``limits`` it renders under and the
    ``variables`` every rendering gets (`data.chat_template_kwargs`, e.g. ``enable_thinking``; a
    rendering's own keyword arguments win). Made by `resolve_chat_template`; pickles with all three, so
    worker processes render, report and bound the same."""

    source: str
    limits: TemplateLimits
    variables: dict

    def __new__(cls, text: str, source: str, limits: TemplateLimits | None = None,
                variables: Mapping[str, Any] | None = None) -> "ChatTemplateText":
        obj = super().__new__(cls, text)
        obj.source, obj.limits = source, TemplateLimits(*(limits or TemplateLimits()))
        obj.variables = dict(variables or {})
        return obj

    def __reduce__(self):
        return (ChatTemplateText, (str(self), self.source, tuple(self.limits), self.variables))


class _LimitHit(Exception):
    """Raised inside a rendering by the checks; render_chat turns it into ChatTemplateLimitExceeded."""

    def __init__(self, what: str, time_limit: bool = False):
        super().__init__(what)
        self.what, self.time_limit = what, time_limit


class _Budget:
    """The limits and the running counts of one rendering."""

    __slots__ = ("limits", "deadline", "cpu_start", "produced")

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.cpu_start = time.thread_time()
        self.produced = 0  # characters of output, all of it (also buffered blocks and macro bodies)

    def tick(self) -> None:
        # The limit is on this thread's CPU time, so a run that is suspended (SIGSTOP, a sleeping
        # laptop) or starved by other processes is not blamed on its template. The wall clock is the
        # cheap first check (a thread's CPU time costs a system call, 12x a monotonic read); the CPU
        # time is read only once the wall clock passes the mark, which then moves to where the CPU
        # time could reach the limit at the earliest.
        now = time.monotonic()
        if now > self.deadline:
            left = self.limits.time_s - (time.thread_time() - self.cpu_start)
            if left <= 0:
                raise _LimitHit(f"ran for more than {self.limits.time_s:g} s of CPU time rendering one "
                                "conversation", time_limit=True)
            self.deadline = now + left

    def need(self, size: int, what) -> None:
        """Refuse a value of ``size`` characters (``what``: text or a function making it, for the message)."""
        if size > self.limits.max_chars:
            raise _LimitHit(f"built {what() if callable(what) else what} of {size:,} characters")

    def check_value(self, value, what: str) -> None:
        self.need(_shallow_size(value), what)


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("specjax_template_budget", default=None)


def _active() -> _Budget:
    budget = _BUDGET.get()
    return budget if budget is not None else _Budget(TemplateLimits())


def _shallow_size(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return _ITEM_CHARS * len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3  # decimal digits, about
    return 0


def _text_size(value, limit: int) -> int:
    """About how many characters ``str(value)`` has (containers walked without recursion); stops
    counting once past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, range):
            total += len(v) * (len(str(max(abs(v.start), abs(v.stop)))) + 3)
        else:  # numbers, None, Undefined, a namespace or loop object: short
            total += 32
    return total


def _shape(value, limit: int) -> tuple[int, int, int]:
    """(`_text_size`, items, nesting depth) of ``value``: what indenting its JSON adds (one line per
    item, indented once per level)."""
    items = depth = 0
    stack = [(value, 1)]
    while stack and items <= limit:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, (list, tuple)):
            items += len(v) + 1
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v)
    return _text_size(value, limit), items, depth


def _ints(values) -> list[int]:
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_NUMBER = re.compile(r"\d+")


def _check_percent(budget: _Budget, fmt: str, args) -> None:
    """``fmt % args`` (the % operator, the format filter): the widths and precisions it asks for."""
    star = False
    width = 0
    for m in _PERCENT_SPEC.finditer(fmt):
        for g in m.groups():
            if g == "*":
                star = True
            elif g:
                width += int(g) if len(g) < 12 else budget.limits.max_chars + 1
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    if star:
        width += sum(abs(v) for v in _ints(values))
    budget.need(len(fmt) + width + _text_size(values, budget.limits.max_chars), "text formatted with %")


def _check_str_format(budget: _Budget, fmt: str, args, kwargs) -> None:
    """``fmt.format(...)``: the widths and precisions of its fields, and the text of its arguments."""
    width = 0
    for field in re.findall(r"\{[^{}]*:([^{}]*)\}", fmt):
        width += sum(int(n) if len(n) < 12 else budget.limits.max_chars + 1 for n in _FORMAT_NUMBER.findall(field))
    values = list(args) + list(kwargs.values())
    if "{" in re.sub(r"\{[^{}]*\}", "", fmt):  # a nested replacement field: a width taken from the arguments
        width += sum(abs(v) for v in _ints(values))
    budget.need(len(fmt) + width + _text_size(values, budget.limits.max_chars), "text formatted with format()")


def _check_str_method(budget: _Budget, s: str, name: str, args: tuple, kwargs: dict) -> None:
    """The str methods whose result can be much larger than the string and their arguments."""
    limit = budget.limits.max_chars
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.need(max([len(s), *_ints(args[:1])]), f"a string padded by {name}()")
    elif name == "expandtabs":
        size = _ints(args[:1] or list(kwargs.values()) or [8])
        budget.need(len(s) + s.count("\t") * max(size or [8]), "a string from expandtabs()")
    elif name == "join" and args:
        items = args[0]
        n = len(items) if hasattr(items, "__len__") else 0
        budget.need(len(s) * max(n - 1, 0) + _text_size(items, limit), "a string joined by join()")
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = s.count(old) if old else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            hits = min(hits, args[2])
        budget.need(len(s) + hits * max(len(new) - len(old), 0), "a string from replace()")
    elif name in ("split", "rsplit"):
        sep = args[0] if args else kwargs.get("sep")
        pieces = s.count(sep) + 1 if isinstance(sep, str) and sep else len(s) // 2 + 1
        budget.need(_ITEM_CHARS * pieces, "a list from split()")
    elif name == "splitlines":
        budget.need(_ITEM_CHARS * (s.count("\n") + s.count("\r") + 1), "a list from splitlines()")


# filters that do not turn their value into text (the others are checked for the text they make)
_KEEPS_VALUE = frozenset(("abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
                          "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
                          "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "unique"))
# filters that make one item per character when given a string
_ITEMIZES = frozenset(("batch", "dictsort", "groupby", "list", "map", "max", "min", "reject", "rejectattr", "select",
                       "selectattr", "slice", "sort", "unique"))
_ESCAPED = "&<>\"'"


def _arg(args: tuple, kwargs: dict, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _check_filter(budget: _Budget, name: str, value, args: tuple, kwargs: dict) -> None:
    """Before filter ``name`` runs on ``value``: what it would build."""
    limit = budget.limits.max_chars
    if name not in _KEEPS_VALUE:
        budget.need(_text_size(value, limit), "the text of a value")
    if name in _ITEMIZES and isinstance(value, str):
        budget.need(_ITEM_CHARS * len(value), f"a list of a string's characters (the {name} filter)")
    n = len(value) if isinstance(value, (str, list, tuple, dict, range)) else 0
    if name == "join":
        sep = _arg(args, kwargs, 0, "d", "")
        budget.need(len(str(sep)) * max(n - 1, 0) + _text_size(value, limit), "a string made by the join filter")
    elif name == "replace":
        _check_str_method(budget, str(value), "replace", args, kwargs)
    elif name == "center":
        budget.need(max([len(str(value)), *_ints([_arg(args, kwargs, 0, "width", 80)])]), "a string padded by center")
    elif name == "indent":
        width = _arg(args, kwargs, 0, "width", 4)
        width = abs(width) if isinstance(width, int) else len(str(width))
        text = str(value)
        budget.need(len(text) + (text.count("\n") + 1) * width, "a string indented by the indent filter")
    elif name == "format":
        _check_percent(budget, str(value), kwargs or args)
    elif name == "tojson":
        indent = _arg(args, kwargs, 1, "indent")
        if indent:
            width = abs(indent) if isinstance(indent, int) else len(str(indent))
            size, items, depth = _shape(value, limit)
            budget.need(size + items * (depth * width + 1), "JSON indented by the tojson filter")
    elif name in ("batch", "slice"):
        count = _ints([_arg(args, kwargs, 0, "linecount" if name == "batch" else "slices", 1)])
        budget.need(_ITEM_CHARS * (n + 8 * max([abs(c) for c in count] or [1])),
                    f"the lists made by the {name} filter")
    elif name in ("e", "escape", "forceescape", "xmlattr", "urlize"):
        text = str(value)
        budget.need(len(text) + 5 * sum(text.count(c) for c in _ESCAPED), "HTML-escaped text")
    elif name == "urlencode":
        budget.need(3 * _text_size(value, limit), "URL-encoded text")
    elif name == "sum":
        start = _arg(args, kwargs, 1, "start", 0)
        if not isinstance(start, (int, float)) and n > 1:  # concatenating sequences copies them again and again
            budget.need(n * _text_size(value, limit) // 2, "the copies made by the sum filter")


def _check_binop(budget: _Budget, operator: str, left, right) -> None:
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                budget.need(_shallow_size(seq) * max(times, 0), lambda: f"a {type(seq).__name__} repeated with *")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise _LimitHit(f"built an integer of more than {_MAX_INT_BITS:,} bits with *")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if (abs(left).bit_length() - 1) * right > _MAX_INT_BITS:
                raise _LimitHit(f"built an integer of more than {_MAX_INT_BITS:,} bits with **")
    elif operator == "+":
        if isinstance(left, str) and isinstance(right, str) or (
                isinstance(left, (list, tuple)) and isinstance(right, (list, tuple))):
            budget.need(_shallow_size(left) + _shallow_size(right), lambda: f"a {type(left).__name__} joined with +")
    elif operator == "%" and isinstance(left, str):
        _check_percent(budget, left, right)


_LOOP_FILTER = "specjax loop"  # names no template can write (a space): the checks the parse adds
_CONCAT_PART_FILTER = "specjax concat part"
_CONCAT_FILTER = "specjax concat"
_OUTPUT_FILTER = "specjax output"


class _TimedItems:
    """A for loop's items, checking the rendering's deadline at every one (``len`` as the items')."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        budget = _active()
        for item in self.items:
            budget.tick()
            yield item

    def __len__(self):
        return len(self.items)


def _jinja_version_ok(version: str) -> bool:
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    return parts + [0] * (3 - len(parts)) >= [3, 1, 6]


@functools.lru_cache(maxsize=None)
def _environment():
    """The Jinja environment of every rendering (built once: jinja2 is imported here, so a missing
    one is an ImportError of the first rendering, not of importing this module)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace, generate_lorem_ipsum

    if not _jinja_version_ok(jinja2.__version__):  # older releases have known sandbox escapes
        raise ChatTemplateUnusable(f"jinja2 {jinja2.__version__} is too old to render chat templates safely; "
                                   "upgrade it: pip install -U 'jinja2>=3.1.6'")

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-span marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

        def render_body(self, caller):
            return caller()

    class TemplateNamespace(Namespace):
        """``namespace()`` without underscore attributes (they lead to Python's internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 - Namespace's signature, so namespace(self=...) works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check_name(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the attribute {name!r} on a namespace")

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` without handing the template the dict type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - Jinja's names
        if isinstance(n, int) and isinstance(max, int):
            _active().need(12 * n * max, "placeholder text (lipsum)")
        return generate_lorem_ipsum(n, html, min, max)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("+", "*", "**", "%"))

        def call_binop(self, context, operator, left, right):
            budget = _active()
            budget.tick()
            _check_binop(budget, operator, left, right)
            result = super().call_binop(context, operator, left, right)
            budget.check_value(result, f"a value with {operator}")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - the sandbox's signature
            budget = _active()
            budget.tick()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str) and isinstance(__obj, types.BuiltinMethodType):
                named = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
                _check_str_method(budget, owner, __obj.__name__, args, named)
            result = super().call(__context, __obj, *args, **kwargs)
            budget.check_value(result, "a value returned by a call")
            return result

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                _check_str_format(_active(), fmt, args, kwargs)
                return wrapped(*args, **kwargs)

            return functools.update_wrapper(checked, wrapped)

    def guarded_filter(name, func):
        @functools.wraps(func)  # keeps Jinja's pass_context / pass_eval_context marks
        def guarded(*args, **kwargs):
            budget = _active()
            budget.tick()
            lead = 1 if args and isinstance(args[0], (Context, EvalContext, jinja2.Environment)) else 0
            if len(args) > lead:
                value = args[lead]
                if name in ("join", "sum") and isinstance(value, (types.GeneratorType, map, filter, zip)):
                    value = list(value)  # its length decides what the filter builds (same items, same result)
                    args = (*args[:lead], value, *args[lead + 1:])
                _check_filter(budget, name, value, args[lead + 1:], kwargs)
            result = func(*args, **kwargs)
            budget.check_value(result, f"a value from the {name} filter")
            return result

        return guarded

    @jinja2.pass_context  # never folded at compile time: these run when the template renders
    def loop_items(_context, items):
        return _TimedItems(items)

    @jinja2.pass_context
    def concat_part(_context, value):
        budget = _active()
        budget.need(_text_size(value, budget.limits.max_chars), "the text of a value joined with ~")
        return value

    @jinja2.pass_context
    def concat(_context, text):
        budget = _active()
        budget.tick()
        budget.check_value(text, "a string joined with ~")
        return text

    @jinja2.pass_context
    def output(_context, value):
        budget = _active()
        budget.tick()
        budget.produced += _text_size(value, budget.limits.max_chars)
        budget.need(budget.produced, "rendered text")
        return value

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: guarded_filter(name, f) for name, f in env.filters.items()}
    env.filters.update({_LOOP_FILTER: loop_items, _CONCAT_PART_FILTER: concat_part, _CONCAT_FILTER: concat,
                        _OUTPUT_FILTER: output})
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace, lipsum=lipsum)
    return env


def _guard(node):
    """Add the checks to a parsed template: loop items, ~ operands and results, output pieces."""
    from jinja2 import nodes

    def wrap(expr, name):
        return nodes.Filter(expr, name, [], [], None, None, lineno=expr.lineno)

    for n in list(node.find_all((nodes.For, nodes.Concat, nodes.Output))):
        if isinstance(n, nodes.For):
            n.iter = wrap(n.iter, _LOOP_FILTER)
        elif isinstance(n, nodes.Concat):
            n.nodes = [wrap(part, _CONCAT_PART_FILTER) for part in n.nodes]
        else:
            n.nodes = [wrap(piece, _OUTPUT_FILTER) for piece in n.nodes]
    # the ~ results: a Concat can sit in any expression, so replace it where its parent holds it
    for parent in list(node.find_all(nodes.Node)):
        for field in parent.fields:
            child = getattr(parent, field, None)
            if isinstance(child, nodes.Concat):
                setattr(parent, field, wrap(child, _CONCAT_FILTER))
            elif isinstance(child, list):
                setattr(parent, field, [wrap(c, _CONCAT_FILTER) if isinstance(c, nodes.Concat) else c for c in child])
    return node


@functools.lru_cache(maxsize=32)
def _compiled(text: str):
    env = _environment()
    tree = _guard(env.parse(text))
    tree.set_environment(env)  # the nodes the checks added
    return env.from_string(tree)


def _plain(value):
    """``value`` rebuilt from plain JSON types, as transformers hands them to a template (str / int /
    float subclasses become the base type, numpy scalars Python numbers, other objects a placeholder
    naming their type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages) -> list[dict]:
    """The conversation as transformers gives it to a template: plain data, keys whose value is None
    dropped, and a message's reasoning (under any of its names) also under ``thinking`` and
    ``reasoning_content``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"Chat messages should be dicts, but got {m!r}.")
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _describe(tokenizer, template: str) -> str:
    if getattr(tokenizer, "chat_template", None) == template:
        return template_source(tokenizer)
    return "the chat template"


def _limit_message(source: str, hit: _LimitHit, limits: TemplateLimits) -> str:
    if hit.time_limit:
        return (f"{source} {hit.what} (data.template_time_limit_s = {limits.time_s:g}): a chat template renders a "
                "conversation in milliseconds, so this one loops without end or does far too much work. Fix the "
                "template, or raise data.template_time_limit_s if it is only slow.")
    if "integer" in hit.what:
        return f"{source} {hit.what}: no chat template needs such numbers. Fix the template."
    return (f"{source} {hit.what}, over data.max_template_chars = {limits.max_chars:,} (the bound on the rendered "
            "text and on every value a template builds; a row within data.max_row_bytes renders to far less). Fix "
            "the template, or raise data.max_template_chars.")


def render_chat(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    """``messages`` rendered with ``template`` as transformers' ``apply_chat_template(...,
    tokenize=False)`` renders them -- the same environment options, globals, tojson filter and
    variables (the tokenizer's ``special_tokens_map``, ``tools`` and ``documents`` (None unless given in
    ``kwargs``), ``add_generation_prompt``, the template's `ChatTemplateText.variables` as
    ``apply_chat_template``'s extra keyword arguments, the other ``kwargs``) -- under the template's limits
    (`ChatTemplateText.limits`, else `TemplateLimits()`). Raises ChatTemplateLimitExceeded when the
    rendering runs past a limit, ChatTemplateUnusable when the template cannot be rendered at all
    (see there); any other exception is the row's and propagates unchanged."""
    limits = getattr(template, "limits", None) or TemplateLimits()
    token = _BUDGET.set(_Budget(limits))
    try:
        compiled = _compiled(str(template))
        tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
        variables = _plain({**(getattr(tokenizer, "special_tokens_map", None) or {}),
                            **(getattr(template, "variables", None) or {}), **kwargs})
        text = compiled.render(messages=_template_messages(messages), tools=_plain(tools),
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt, **variables)
    except _LimitHit as hit:
        source = getattr(template, "source", None) or _describe(tokenizer, template)
        raise ChatTemplateLimitExceeded(_limit_message(source, hit, limits)) from None
    except ChatTemplateUnusable:
        raise
    except Exception as e:  # noqa: BLE001 - classified, then re-raised
        env = _environment_problem(e)
        if env is not None:
            raise env from e
        raise
    finally:
        _BUDGET.reset(token)
    return text


_PROBE = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}]


def check_chat_template(tokenizer=None, template: str | None = None, limits: TemplateLimits | None = None,
                        variables: Mapping[str, Any] | None = None) -> None:
    """Before any expensive stage: jinja2 importable, and (with a tokenizer) the template renders a
    two-turn probe conversation within ``limits`` (default `TemplateLimits()`) with ``variables``. Raises
    ChatTemplateUnusable naming the cause and the fix (ChatTemplateLimitExceeded for a limit). A
    template that rejects the probe for a row-like reason (e.g. it requires a system turn) passes:
    rows are judged one by one later."""
    try:
        import jinja2  # noqa: F401
    except ImportError as e:
        raise ChatTemplateUnusable(f"cannot import jinja2 ({e}). Fix: {_JINJA_FIX}.") from None
    if tokenizer is None:
        return
    tmpl = resolve_chat_template(tokenizer, template, limits, variables)
    try:
        render_chat(tokenizer, tmpl, _PROBE, add_generation_prompt=False)
    except ChatTemplateLimitExceeded:
        raise  # names the template already
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


def resolve_chat_template(tokenizer, chat_template: str | None = None, limits: TemplateLimits | None = None,
                          variables: Mapping[str, Any] | None = None) -> ChatTemplateText:
    """The template to use: an explicit string (or path to a file holding one), else the
    tokenizer's own, as a `ChatTemplateText` naming its source, rendering under ``limits`` and with
    ``variables`` (each default: what ``chat_template`` already carries, else `TemplateLimits()` / none).
    No template at all is a configuration error, not a bad row."""
    if isinstance(chat_template, ChatTemplateText):
        same_limits = limits is None or TemplateLimits(*limits) == chat_template.limits
        if same_limits and (variables is None or dict(variables) == chat_template.variables):
            return chat_template
        return ChatTemplateText(chat_template, chat_template.source, chat_template.limits if limits is None else limits,
                                chat_template.variables if variables is None else variables)
    if chat_template:
        if "{" not in chat_template and os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return ChatTemplateText(f.read(), template_source(tokenizer, chat_template), limits, variables)
        return ChatTemplateText(chat_template, template_source(tokenizer, chat_template), limits, variables)
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # some tokenizers carry several named templates
        tmpl = tmpl.get("default") or next(iter(tmpl.values()), None)
    if not tmpl:
        raise ValueError(f"the tokenizer has no chat template; {CHAT_TEMPLATE_HINT}")
    return ChatTemplateText(tmpl, template_source(tokenizer), limits, variables)


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
    except ChatTemplateUnusable:
        raise
    except Exception:  # a template that rejects this history
        return None
    if not full.startswith(base):
        return None
    best = None
    for kwargs in ({},) + _NO_THINKING_KWARGS:
        try:
            prompt = _render(tokenizer, template, history, add_generation_prompt=True, **kwargs)
        except ChatTemplateUnusable:
            raise
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
        except ChatTemplateUnusable:
            raise
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
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
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

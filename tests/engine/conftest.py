"""Engine tier (tests/engine/README.md): session fixtures and the equality table at the end."""
from __future__ import annotations

import pytest

from _engine_harness import TABLE


@pytest.fixture(scope="session")
def engine_workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TABLE:
        return
    tr = terminalreporter
    tr.section("engine tier: specjax.eval vs vLLM (greedy, fp32)")
    tr.write_line("| target | head | K | specjax steps | vLLM drafts | specjax accepted/pos | vLLM accepted/pos | "
                  "tau specjax | tau vLLM | spec == non-spec |")
    tr.write_line("|---|---|---|---|---|---|---|---|---|---|")
    for r in TABLE:
        tr.write_line(f"| {r['target']} | {r['head']} | {r['k']} | {r.get('sj_steps', '-')} | {r['vllm_drafts']} | "
                      f"{r.get('sj_acc', '-')} | {r['vllm_acc']} | {r.get('sj_tau', '-')} | {r['vllm_tau']} | "
                      f"{r['lossless']} |")

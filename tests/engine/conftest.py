"""Engine tier (tests/engine/README.md): session fixtures and the equality table at the end."""
from __future__ import annotations

import pytest

from _engine_harness import TABLE


@pytest.fixture(scope="session")
def engine_workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="session")
def llama_target(built_once):
    """The tier's Llama demo target (_engine_models.LLAMA_TARGET: 200 pretraining steps), built once
    per run: test_vllm_equality.py and test_decode_eval_vllm.py both use it, and under xdist they
    run on different workers (tests/conftest.py's `built_once`: a file lock in the run's base temp
    folder; the second worker finds the finished build, which ensure_demo_target reuses)."""
    import _engine_models as M

    with built_once("engine_llama_target") as path:
        return M.build_llama_target(path)


@pytest.fixture(scope="session")
def demo_target_and_head(tmp_path_factory):
    """A tiny target vLLM's CPU backend can run, and an EAGLE-3 head trained on it for 10 steps
    (float32 export), shared by the specjax.bench engine tests."""
    from specjax.config import load_config
    from specjax.demo import ensure_demo_target
    from specjax.train.loop import train

    root = tmp_path_factory.mktemp("bench_head")
    target = ensure_demo_target(root / "target", vocab_size=320, log=None, hidden=64, layers=4, heads=2,
                                kv_heads=1, intermediate=128, steps=40, seq_len=128, batch_size=8)
    out = root / "run"
    cfg = load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=200",
        "data.seq_length=128", "data.batch_size=8", "data.val_fraction=0.05",
        "draft.ttt_steps=2", "draft.draft_vocab_size=128", "optim.lr=3e-3",
        "train.steps=10", "train.log_every=5", "train.eval_batches=1", "train.progress=false",
        "checkpoint.every_steps=0", "export.at_end=true", "export.dtype=float32",
    ])
    train(cfg)
    head = out / "export"
    assert (head / "model.safetensors").is_file()
    return str(target), str(head)


def pytest_sessionfinish(session):
    # under xdist (.ci/run runs this tier with -n 2) the rows are filled in a worker: send them to
    # the controller, which prints the table
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["engine_table"] = [dict(r, key=list(r["key"])) for r in TABLE]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for r in getattr(node, "workeroutput", {}).get("engine_table", []):
        TABLE.append(dict(r, key=tuple(r["key"])))


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

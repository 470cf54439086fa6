"""An environment or configuration problem stops the run at once, with one message, before any
expensive stage; it is never counted as thousands of bad rows.

The first case is the one a new user met: transformers renders chat templates with jinja2, and a
machine without it used to skip every row as a "chat template error" after building the target.
Here jinja2 is made unimportable the way an uninstalled package is (`sys.modules["jinja2"] = None`
in a sitecustomize: `import jinja2` raises ModuleNotFoundError and importlib finds no spec), and the
real CLI runs the real default config."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specjax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_jinja2_stops_the_demo_before_the_target_is_built(tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text('import sys\nsys.modules["jinja2"] = None  # as if not installed\n')
    target = tmp_path / "demo_target"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "specjax.launch", "--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"),
         f"run.output_dir={tmp_path / 'run'}", f"target.path={target}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out  # one message, not one per row
    assert "jinja2" in errors[0] and "pip install" in errors[0], errors[0]
    assert "skipped" not in out and "chat template error" not in out
    # stopped before the demo target (tokenizer + pretraining) was built or any step compiled
    assert not target.exists() and "[demo]" not in out and "train:" not in out


def _cfg(tmp_path, tiny_target, *overrides):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    return load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), [
        f"run.output_dir={tmp_path / 'run'}", f"target.path={tiny_target}", "target.build_demo=false",
        f"data.train_files=[{data}]", *overrides])


@pytest.fixture
def no_target_build(monkeypatch):
    from specjax.train import run

    def refuse(*a, **k):
        raise AssertionError("the target was built before the environment check")

    monkeypatch.setattr(run, "prepare_target_folder", refuse)
    monkeypatch.setattr(run, "load_prepared_target", refuse)


def test_template_that_does_not_compile_stops_before_the_target(tmp_path, tiny_target, no_target_build):
    from specjax.data.chat import ChatTemplateUnusable
    from specjax.train.loop import train

    cfg = _cfg(tmp_path, tiny_target, "data.chat_template={% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateUnusable, match=r"does not compile .*data\.chat_template"):
        train(cfg)


def test_unloadable_tokenizer_stops_before_the_target(tmp_path, tiny_target, no_target_build):
    from specjax.train.loop import train

    bad = tmp_path / "tok"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot load the tokenizer from .*tok.*\. Fix: set data\.tokenizer.*"
                                         r"\(transformers: "):
        train(_cfg(tmp_path, tiny_target, f"data.tokenizer={bad}"))


def test_a_folder_without_tokenizer_files_names_them_and_the_fix(tmp_path, tiny_target, no_target_build):
    """The fix comes first, not transformers' advice (install sentencepiece, ...)."""
    from specjax.train.loop import train

    empty = tmp_path / "no_tok"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no tokenizer in .*no_tok.*none of tokenizer\.json, tokenizer_config\.json, "
                                         r"tokenizer\.model is there\. Fix: set data\.tokenizer") as e:
        train(_cfg(tmp_path, tiny_target, f"data.tokenizer={empty}"))
    assert "sentencepiece" not in str(e.value)


def test_a_rows_template_error_is_still_a_counted_skip(tiny_target):
    """raise_exception() inside a template is about that row (here: a system turn the template
    refuses), so it stays a counted skip; the environment check passes."""
    from transformers import AutoTokenizer

    from specjax.data.chat import SkipRow, check_chat_template, tokenize_conversation

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tmpl = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}"
            "{% endif %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}")
    check_chat_template(tok, tmpl)
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    with pytest.raises(SkipRow, match="chat template error.*no system turns"):
        tokenize_conversation(tok, msgs, 64, chat_template=tmpl)


def test_a_template_past_a_rendering_limit_stops_the_cli_before_the_target(tmp_path, tiny_target):
    """A chat template that would build a 10 GB string is found by the preflight's probe conversation:
    one error line naming the template file and the limit's config key, before the target is loaded and
    in bounded memory (the real CLI, in a subprocess under RLIMIT_AS). Its time limit is checked the same
    way (tests/data/test_template_limits.py)."""
    template = tmp_path / "explodes.jinja"
    template.write_text("{{ 'x' * 10**10 }}{% for m in messages %}{{ m.content }}{% endfor %}")
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    argv = ["specjax.launch", "--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"),
            f"run.output_dir={tmp_path / 'run'}", f"target.path={tiny_target}", "target.build_demo=false",
            f"data.train_files=[{data}]", f"data.chat_template={template}"]
    bounded = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30)); "
               f"sys.argv = {argv!r}; runpy.run_module('specjax.launch', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", bounded], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the chat template file {template} built a str repeated with * of 10,000,000,000 "
                      "characters, over data.max_template_chars = 67,108,864 (the bound on the rendered text and on "
                      "every value a template builds; a row within data.max_row_bytes renders to far less). Fix the "
                      "template, or raise data.max_template_chars."], out
    assert "skipped" not in out and "train:" not in out


@pytest.mark.parametrize("override, match", [
    ("target.aux_layer_ids=[0,9,10]", r"aux_layer_ids \(0, 9, 10\) out of range: valid ids are 0\.\.3"),
    ("draft.draft_vocab_size=400", r"draft\.draft_vocab_size=400 is larger than the target's vocab \(320 tokens"),
])
def test_draft_that_does_not_fit_the_target_stops_before_the_data(tmp_path, tiny_target, monkeypatch, override, match):
    """Bad taps or a draft vocab larger than the target's are found from config.json, before the data
    pass (minutes of tokenization on a real data set) and before the weights load."""
    from specjax.train import run
    from specjax.train.loop import train

    def refuse(*a, **k):
        raise AssertionError("reached the data pass / weight load before the draft check")

    monkeypatch.setattr(run, "_prepare_data", refuse)
    monkeypatch.setattr(run, "load_prepared_target", refuse)
    with pytest.raises(ValueError, match=match):
        train(_cfg(tmp_path, tiny_target, override))

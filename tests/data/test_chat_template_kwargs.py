"""data.chat_template_kwargs: the chat template's variables (e.g. enable_thinking), given to every
rendering the same way: the training data (and so precompute, which prepares the same examples and
records them in the cache manifest), the regeneration stage (the jax back end's prompts; the openai
back end's requests), decode_eval and `specjax.eval`.

The template below writes a marker into each assistant turn and the generation prompt unless
enable_thinking is false, as Qwen3's writes an empty think block; every check is that the marker
appears exactly when the variable says so."""
import pickle

import pytest

from specjax.config import load_config
from specjax.data.chat import render_chat, resolve_chat_template
from specjax.data.pipeline import prepare_examples

from _tok import build_tokenizer

MARK = " cat and dog "
THINKING = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and enable_thinking is defined and not enable_thinking %}"
    "{{ '" + MARK + "' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '" + MARK + "' }}{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "I am fine, thank you."}]


def _jsonl(tmp_path, n=6):
    import json

    p = tmp_path / "chats.jsonl"
    p.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(n)))
    return str(p)


def test_config_key_and_the_template_text_carry_the_variables():
    cfg = load_config(None, ["data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert load_config(None, []).data.chat_template_kwargs == {}
    tok = build_tokenizer(THINKING)
    tmpl = resolve_chat_template(tok, None, variables=cfg.data.chat_template_kwargs)
    assert MARK in render_chat(tok, tmpl, CHAT, add_generation_prompt=False)
    assert MARK not in render_chat(tok, resolve_chat_template(tok), CHAT, add_generation_prompt=False)
    # a worker process gets them with the template (pickled), and a rendering's own kwargs win
    again = pickle.loads(pickle.dumps(tmpl))
    assert again.variables == {"enable_thinking": False}
    assert MARK not in render_chat(tok, again, CHAT, add_generation_prompt=False, enable_thinking=True)


def test_training_examples_and_the_cache_manifest(tmp_path):
    from specjax.data.state_cache import manifest_differences
    from specjax.train.cache_source import cache_fields

    tok = build_tokenizer(THINKING)
    path = _jsonl(tmp_path)
    texts = {}
    for variables in (None, {"enable_thinking": False}):
        prep = prepare_examples([path], tok, 64, 0.0, 0, template_variables=variables)
        ex = prep.train[0]
        texts[bool(variables)] = tok.decode(ex.input_ids)
        trained = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        # the marker is part of what the template emits as the generation prompt (as Qwen3's empty think
        # block is), so it is in the row but not trained on
        assert "fine, thank you." in trained and MARK.strip() not in trained
    assert MARK.strip() in texts[True] and MARK.strip() not in texts[False]

    class Prepared:
        train, val = prep.train, prep.val

    def fields(*overrides):
        cfg = load_config(None, [f"target.path={tmp_path}", *overrides])
        return cache_fields(cfg, Prepared, tok, (1, 2, 3))

    (tmp_path / "config.json").write_text("{}")
    diffs = manifest_differences(fields(), fields("data.chat_template_kwargs={enable_thinking: false}"))
    assert [d.split(":")[0] for d in diffs] == ["data.chat_template_kwargs"]


def test_regeneration_renders_and_sends_them(monkeypatch, tmp_path):
    import specjax.regenerate as regen
    from specjax.regen.jax_backend import JaxBackend

    tok = build_tokenizer(THINKING)
    prompt = CHAT[:1]
    for variables, marked in ((None, False), ({"enable_thinking": False}, True)):
        backend = JaxBackend(None, tok, chat_template=None, eos_ids=[tok.eos_token_id], max_new_tokens=4,
                             temperature=0.0, top_p=1.0, max_prompt_tokens=64, batch_size=8, seed=0,
                             keep_reasoning=True, generate_fn=lambda *a, **k: None, template_variables=variables)
        assert (MARK.strip() in tok.decode(backend.encode(prompt))) == marked
    seen = {}
    monkeypatch.setattr(regen, "_run", lambda **a: seen.update(a))
    regen.regenerate(input=_jsonl(tmp_path), out_dir=str(tmp_path / "out"), backend="openai", model="m",
                     endpoint="http://127.0.0.1:1/v1", template_variables={"enable_thinking": False})
    assert seen["extra_body"] == {"chat_template_kwargs": {"enable_thinking": False}}
    regen.regenerate(input=_jsonl(tmp_path), out_dir=str(tmp_path / "out"), backend="openai", model="m",
                     endpoint="http://127.0.0.1:1/v1", extra_body={"chat_template_kwargs": {"x": 1}},
                     template_variables={"enable_thinking": False})
    assert seen["extra_body"] == {"chat_template_kwargs": {"x": 1}}  # the explicit body wins


@pytest.mark.parametrize("value, problem", [("nope", "is not JSON"), ("[1]", "must be a JSON object")])
def test_eval_cli_refuses_bad_kwargs(value, problem, capsys, tmp_path):
    from specjax.eval.cli import main

    assert main(["--target", str(tmp_path), "--draft", str(tmp_path), "--chat-template-kwargs", value]) == 2
    assert problem in capsys.readouterr().err

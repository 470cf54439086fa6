"""data.mask_reasoning_content / data.mask_generation_prompt on a Qwen3-style template.

The template below is written for this test (same rendering rules as Qwen3's, in short): an
assistant turn after the last user message is rendered with a reasoning block
`<think>\\n{reasoning}\\n</think>\\n\\n` (empty when the content has none); earlier assistant turns
lose their reasoning; the generation prompt is `<|im_start|>assistant\\n`, plus an empty reasoning
block when `enable_thinking` is false."""
from __future__ import annotations

import json

import numpy as np
import pytest

from _tok import CHATML, CHATML_WITH_TRAILER, build_tokenizer
from specjax.data import prepare_examples, tokenize_conversation
from specjax.data.chat import SkipRow

END = "<|im_end|>"

QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set answer = m['content'] %}{%- set thought = '' %}"
    "{%- if '</think>' in m['content'] %}"
    "{%- set answer = m['content'].split('</think>')[-1].lstrip('\\n') %}"
    "{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# DeepSeek-R1 style: the generation prompt opens the reasoning block itself.
OPENS_THINK = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")


def _tok(template):
    t = build_tokenizer(template)
    t.add_tokens(["<think>", "</think>"])  # plain added tokens, as in Qwen3's vocabulary
    return t


@pytest.fixture(scope="module")
def qtok():
    return _tok(QWEN3_STYLE)


def conv(*turns):
    return [{"role": r, "content": c} for r, c in turns]


def runs(tok, ex):
    """Decoded text of each contiguous run of supervised tokens."""
    out, cur = [], []
    for t, m in zip(ex.input_ids.tolist(), ex.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [tok.decode(r) for r in out]


def masks(tok, msgs, **kw):
    return {
        flags: runs(tok, tokenize_conversation(tok, msgs, 512, mask_reasoning_content=flags[0],
                                               mask_generation_prompt=flags[1], **kw))
        for flags in [(False, False), (True, False), (False, True), (True, True)]
    }


def test_template_renders_as_intended(qtok):
    msgs = conv(("user", "Hello there!"), ("assistant", "I am fine."))
    assert qtok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nHello there!<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nI am fine.<|im_end|>\n"
    )
    assert qtok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True,
                                    enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")


def test_reasoning_turn(qtok):
    msgs = conv(("user", "Hello there!"), ("assistant", "<think>\nThe user greets me.\n</think>\n\nI am fine, thank you."))
    m = masks(qtok, msgs)
    full_turn = "<think>\nThe user greets me.\n</think>\n\nI am fine, thank you." + END
    assert m[(False, False)] == [full_turn]
    assert m[(True, False)] == ["I am fine, thank you." + END]
    # A non-empty reasoning block is not what any generation prompt supplies: stays supervised.
    assert m[(False, True)] == [full_turn]
    assert m[(True, True)] == ["I am fine, thank you." + END]


def test_empty_reasoning_block_is_the_non_thinking_generation_prompt(qtok):
    msgs = conv(("user", "Hello there!"), ("assistant", "I am fine."))
    m = masks(qtok, msgs)
    assert m[(False, False)] == ["<think>\n\n</think>\n\nI am fine." + END]
    assert m[(True, False)] == ["I am fine." + END]
    assert m[(False, True)] == ["I am fine." + END]
    assert m[(True, True)] == ["I am fine." + END]

    # Hand-checked positions: the supervised tokens are exactly those after the empty block.
    ex = tokenize_conversation(qtok, msgs, 512, mask_generation_prompt=True)
    toks = qtok.convert_ids_to_tokens(ex.input_ids.tolist())
    close = toks.index("</think>")
    end = toks.index(END, close)
    # after </think> come the line breaks (not supervised), then the answer up to and incl. END
    first = next(i for i in range(close + 1, end) if qtok.decode(ex.input_ids[i : i + 1]).strip())
    expected = np.zeros(len(toks), np.int32)
    expected[first : end + 1] = 1
    np.testing.assert_array_equal(ex.loss_mask, expected)
    assert qtok.decode(ex.input_ids[close + 1 : first]) == "\n\n"


def test_multi_turn_history_loses_reasoning(qtok):
    msgs = conv(
        ("system", "You are a helpful assistant."),
        ("user", "Hello"),
        ("assistant", "<think>\nsay hi\n</think>\n\nHello there!"),
        ("user", "Tell me a story"),
        ("assistant", "<think>\na cat story\n</think>\n\nOnce upon a time, a cat."),
    )
    # The template drops the first turn's reasoning, so that turn is found by its answer.
    m = masks(qtok, msgs)
    assert m[(False, False)] == ["Hello there!" + END, "<think>\na cat story\n</think>\n\nOnce upon a time, a cat." + END]
    assert m[(True, True)] == ["Hello there!" + END, "Once upon a time, a cat." + END]


@pytest.mark.parametrize("template", [CHATML, CHATML_WITH_TRAILER])
def test_generation_prompt_mask_changes_nothing_when_prompt_is_only_the_header(template):
    # ChatML's generation prompt is the role header, which is never supervised; with a trailer
    # the prefix property breaks and the turn stays as it was.
    t = _tok(template)
    msgs = conv(("user", "Hello"), ("assistant", "I am fine."), ("user", "And?"), ("assistant", "Thank you."))
    m = masks(t, msgs)
    assert m[(False, False)] == m[(False, True)] == ["I am fine." + END, "Thank you." + END]


def test_generation_prompt_that_opens_the_reasoning_block():
    t = _tok(OPENS_THINK)
    msgs = conv(("user", "Hello"), ("assistant", "the user greets\n</think>\n\nHi, how are you?"))
    m = masks(t, msgs)
    # the generation prompt (role header + "<think>\n") is never supervised; the orphan closing
    # tag ends a reasoning block that started with the turn
    assert m[(False, False)] == ["the user greets\n</think>\n\nHi, how are you?" + END]
    assert m[(True, False)] == ["Hi, how are you?" + END]


def test_only_reasoning_left_is_a_counted_skip(qtok):
    msgs = conv(("user", "Hello"), ("assistant", "<think>\nthinking until the tokens ran out"))
    assert runs(qtok, tokenize_conversation(qtok, msgs, 512))  # supervised without the flag
    with pytest.raises(SkipRow) as e:
        tokenize_conversation(qtok, msgs, 512, mask_reasoning_content=True)
    assert e.value.reason == "no assistant token outside reasoning"


def test_prepare_examples_threads_the_flags(tmp_path, qtok):
    rows = [
        conv(("user", "Hello"), ("assistant", "<think>\nhm\n</think>\n\nHi.")),
        conv(("user", "Hi"), ("assistant", "Hello!")),
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    plain = prepare_examples([p], qtok, 512, 0.0, 0)
    masked = prepare_examples([p], qtok, 512, 0.0, 0, mask_reasoning_content=True, mask_generation_prompt=True)
    assert [runs(qtok, e) for e in masked.train] == [["Hi." + END], ["Hello!" + END]]
    assert [runs(qtok, e) for e in plain.train] == [
        ["<think>\nhm\n</think>\n\nHi." + END], ["<think>\n\n</think>\n\nHello!" + END]]
    for a, b in zip(plain.train, masked.train):  # same tokens, fewer supervised
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        assert b.loss_mask.sum() < a.loss_mask.sum()

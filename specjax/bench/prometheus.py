"""Prometheus text exposition: a small parser and the speculative-decoding counters of vLLM / SGLang.

`parse_prometheus(text)` reads the text format (and the OpenMetrics text that prometheus_client
writes): comments, `# TYPE`/`# HELP`, samples `name{label="value",...} value [timestamp]` with
escaped label values (`\\\\`, `\\"`, `\\n`) and the special values `+Inf`, `-Inf`, `NaN`.
A page is untrusted input, so parsing is bounded: a line longer than `MAX_LINE_CHARS`, a label
value longer than `MAX_LABEL_VALUE_CHARS`, more than `MAX_LABELS` labels on a sample or more than
`max_samples` samples kept is a ValueError naming the line. `keep` (a tuple of name prefixes)
keeps only the samples of those families (the others are checked for a name only), which is what
the benchmark reads.

`spec_counters(scrape)` picks the speculative-decoding numbers out of one scrape:

* vLLM (v1 engine, `vllm/v1/spec_decode/metrics.py` `SpecDecodingProm`): cumulative counters
  `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
  `vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos`
  (label `position="0".."K-1"`). prometheus_client exposes a counter family `X` as the sample
  `X_total` (plus `X_created`, a timestamp, which is ignored); both `X` and `X_total` are accepted.
  Series are summed over their other labels (`model_name`, `engine`: one series per engine core).
  From two scrapes: tau = 1 + accepted / drafts, per-position acceptance = accepted_i / drafts.
* SGLang (`sglang/srt/metrics/collector.py`): no cumulative spec-decode counters, only the gauges
  `sglang:spec_accept_length` and `sglang:spec_accept_rate`, which SGLang sets from a recent window
  of batches. They are read as they are after a level (point values, no interval, no per-position
  acceptance); they are not differences of counters, so they are not comparable to vLLM's numbers
  to more than a rough degree.

A scrape whose spec-decode numbers cannot be right is refused with a ValueError naming the metric
(the caller records it and does not use that scrape): a counter that is NaN, infinite or negative,
or an `accepted_tokens_per_pos` sample whose `position` is not an integer in 0..MAX_POSITIONS-1 (no
speculative method drafts a thousand tokens; a position of 10^7 would otherwise make an array of
10^7 entries). `counters_delta` refuses counters that went down between two scrapes.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

__all__ = [
    "Sample", "Scrape", "SpecCounters", "parse_prometheus", "spec_counters", "counters_delta",
    "detect_engine", "VLLM_DRAFTS", "VLLM_DRAFT_TOKENS", "VLLM_ACCEPTED", "VLLM_ACCEPTED_PER_POS",
    "SGLANG_ACCEPT_LENGTH", "SGLANG_ACCEPT_RATE", "SPEC_PREFIXES", "MAX_POSITIONS", "MAX_SAMPLES",
    "MAX_LINE_CHARS", "MAX_LABEL_VALUE_CHARS", "MAX_LABELS",
]

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"
# the families spec_counters reads: what a bounded scrape keeps
SPEC_PREFIXES = ("vllm:spec_decode_", "sglang:spec_")

MAX_POSITIONS = 1024  # draft positions accepted from a page (EAGLE/MTP drafts are < 20 long)
MAX_SAMPLES = 100_000  # samples kept from one page (a vLLM engine exposes ~450)
MAX_LINE_CHARS = 1 << 16
MAX_LABEL_VALUE_CHARS = 4096  # a model path is the longest value a serving engine writes
MAX_LABELS = 256  # vLLM's cache_config_info carries 37

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Sample:
    """One sample line: metric name, its labels and its value."""
    name: str
    labels: dict
    value: float


@dataclass
class Scrape:
    """A parsed /metrics page: every sample kept, in order, the `# TYPE` of each family kept, and
    which engines' metric prefixes ("vllm", "sglang") appeared anywhere on the page."""
    samples: list[Sample]
    types: dict[str, str] = field(default_factory=dict)
    engines: frozenset = frozenset()

    def series(self, family: str, *, counter: bool = False) -> list[Sample]:
        """The samples of `family`. With counter=True also (and preferably) `family_total`: a
        counter is written `X_total` by prometheus_client and OpenMetrics, `X` by older clients."""
        if counter:
            total = [s for s in self.samples if s.name == family + "_total"]
            if total:
                return total
        return [s for s in self.samples if s.name == family]

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


# ---------------------------------------------------------------------------------------------
# parsing


def _parse_value(tok: str, where: str) -> float:
    t = tok.strip()
    low = t.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"{where}: cannot parse the sample value {tok[:100]!r}") from None


def _parse_labels(line: str, i: int, where: str) -> tuple[dict, int]:
    """Labels from line[i] == '{' to the matching '}'; returns (labels, index after '}')."""
    labels: dict[str, str] = {}
    n = len(line)
    i += 1
    while True:
        while i < n and line[i] in " \t,":
            i += 1
        if i >= n:
            raise ValueError(f"{where}: unterminated label set")
        if line[i] == "}":
            return labels, i + 1
        if len(labels) >= MAX_LABELS:
            raise ValueError(f"{where}: more than {MAX_LABELS} labels on one sample")
        j = line.find("=", i)
        if j < 0:
            raise ValueError(f"{where}: a label without '='")
        key = line[i:j].strip()
        i = j + 1
        while i < n and line[i] in " \t":
            i += 1
        if i >= n or line[i] != '"':
            raise ValueError(f"{where}: label {key!r} has no quoted value")
        i += 1
        buf = []
        while True:
            if i >= n:
                raise ValueError(f"{where}: unterminated value of label {key!r}")
            c = line[i]
            if c == "\\" and i + 1 < n:
                nxt = line[i + 1]
                buf.append({"n": "\n", '"': '"', "\\": "\\"}.get(nxt, "\\" + nxt))
                i += 2
                continue
            if c == '"':
                i += 1
                break
            buf.append(c)
            i += 1
        if len(buf) > MAX_LABEL_VALUE_CHARS:
            raise ValueError(f"{where}: the value of label {key[:100]!r} is longer than {MAX_LABEL_VALUE_CHARS} "
                             "characters")
        labels[key] = "".join(buf)


def _lines(text: str):
    """(line number, line) without splitting the whole page at once."""
    start, n, lineno = 0, len(text), 0
    while start < n:
        end = text.find("\n", start)
        if end < 0:
            end = n
        lineno += 1
        yield lineno, text[start:end]
        start = end + 1


def parse_prometheus(text: str, keep: Optional[tuple] = None, max_samples: int = MAX_SAMPLES) -> Scrape:
    """Parse Prometheus / OpenMetrics text into a `Scrape` (the samples; `# TYPE` per family).

    A malformed sample line (or one past the bounds in the module docstring) is a ValueError naming
    its line number; blank lines, `# HELP`, `# EOF` and other comments are skipped. `keep`: name
    prefixes of the samples to keep (default: all)."""
    samples: list[Sample] = []
    types: dict[str, str] = {}
    engines: set[str] = set()
    for lineno, raw in _lines(text):
        where = f"/metrics line {lineno}"
        if len(raw) > MAX_LINE_CHARS:
            raise ValueError(f"{where}: longer than {MAX_LINE_CHARS} characters ({len(raw)}); not a metrics page "
                             "a serving engine writes")
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE" and (keep is None or parts[2].startswith(keep)):
                types[parts[2]] = parts[3].strip()
            continue
        m = _NAME.match(line)
        if m is None:
            raise ValueError(f"{where}: not a sample line: {raw[:200]!r}")
        name, i = m.group(0), m.end()
        if name.startswith("vllm:"):
            engines.add("vllm")
        elif name.startswith("sglang:"):
            engines.add("sglang")
        if keep is not None and not name.startswith(keep):
            continue
        while i < len(line) and line[i] in " \t":
            i += 1
        labels: dict = {}
        if i < len(line) and line[i] == "{":
            labels, i = _parse_labels(line, i, where)
        rest = line[i:].split()
        if not rest:
            raise ValueError(f"{where}: a sample without a value: {raw[:200]!r}")
        if len(samples) >= max_samples:
            raise ValueError(f"{where}: more than {max_samples} samples; not a metrics page a serving engine writes")
        samples.append(Sample(name, labels, _parse_value(rest[0], where)))
    return Scrape(samples, types, frozenset(engines))


def detect_engine(scrape: Scrape) -> Optional[str]:
    """'vllm' or 'sglang' from the metric-name prefixes, else None."""
    names = scrape.names()
    if "vllm" in scrape.engines or any(n.startswith("vllm:") for n in names):
        return "vllm"
    if "sglang" in scrape.engines or any(n.startswith("sglang:") for n in names):
        return "sglang"
    return None


# ---------------------------------------------------------------------------------------------
# speculative-decoding counters


@dataclass
class SpecCounters:
    """Spec-decode numbers of one scrape (cumulative for vLLM), or the difference of two scrapes.

    `available` is False when the server exposes no spec-decode metric (a server without a draft,
    or an engine we do not know); vLLM's counters appear only once speculation is configured."""
    engine: Optional[str] = None
    available: bool = False
    drafts: float = 0.0  # verification steps that carried a draft (vLLM: num_drafts)
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list = field(default_factory=list)  # [K]
    # SGLang's windowed gauges (point values; None elsewhere)
    sglang_accept_length: Optional[float] = None
    sglang_accept_rate: Optional[float] = None

    @property
    def num_positions(self) -> int:
        return len(self.accepted_per_pos)

    @property
    def tau(self) -> float:
        """1 + accepted / drafts (nan without drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else math.nan

    def to_dict(self) -> dict:
        return asdict(self)


def _sum_series(samples: Iterable[Sample], model: Optional[str]) -> float:
    total = 0.0
    for s in samples:
        if model is not None and "model_name" in s.labels and s.labels["model_name"] != model:
            continue
        total += _counter_value(s)
    return total


def _counter_value(s: Sample) -> float:
    """A spec-decode counter's value: finite and >= 0, else the scrape is refused."""
    if not math.isfinite(s.value) or s.value < 0:
        raise ValueError(f"/metrics: {s.name} is {s.value} (a counter is a finite number >= 0); this scrape is "
                         "not used")
    return s.value


def _position(s: Sample) -> int:
    raw = s.labels.get("position")
    try:
        pos = int(raw) if raw is not None and len(raw) <= 6 else -1
    except ValueError:
        pos = -1
    if not 0 <= pos < MAX_POSITIONS:
        shown = "no position label" if raw is None else f"position={raw[:20]!r}"
        raise ValueError(f"/metrics: {s.name} has a sample with {shown}, not a draft position 0..{MAX_POSITIONS - 1} "
                         "(no speculative method drafts that many tokens); this scrape is not used")
    return pos


def _model_filter(scrape: Scrape, model: Optional[str]) -> Optional[str]:
    """Filter on model_name only when the scrape actually has that model (a served name can differ
    from the path the metrics carry)."""
    if model is None:
        return None
    seen = {s.labels.get("model_name") for s in scrape.samples if s.name.startswith("vllm:spec_decode")}
    return model if model in seen else None


def spec_counters(scrape: Scrape, model: Optional[str] = None) -> SpecCounters:
    """The spec-decode numbers of `scrape` (see the module docstring for the names read).

    `model`: keep only series whose `model_name` label equals it (when the page has such series;
    otherwise every series is summed). A ValueError when a counter is not a finite number >= 0 or a
    position is out of range (see the module docstring)."""
    engine = detect_engine(scrape)
    drafts = scrape.series(VLLM_DRAFTS, counter=True)
    if drafts:
        m = _model_filter(scrape, model)
        per_pos: dict[int, float] = {}
        for s in scrape.series(VLLM_ACCEPTED_PER_POS, counter=True):
            if m is not None and "model_name" in s.labels and s.labels["model_name"] != m:
                continue
            pos = _position(s)
            per_pos[pos] = per_pos.get(pos, 0.0) + _counter_value(s)
        k = max(per_pos) + 1 if per_pos else 0
        return SpecCounters(
            engine="vllm", available=True,
            drafts=_sum_series(drafts, m),
            draft_tokens=_sum_series(scrape.series(VLLM_DRAFT_TOKENS, counter=True), m),
            accepted=_sum_series(scrape.series(VLLM_ACCEPTED, counter=True), m),
            accepted_per_pos=[per_pos.get(i, 0.0) for i in range(k)],
        )
    length = scrape.series(SGLANG_ACCEPT_LENGTH)
    if length:
        rate = scrape.series(SGLANG_ACCEPT_RATE)
        # one gauge per rank (tp/dp labels): the mean of the ranks that report something
        vals = [s.value for s in length if math.isfinite(s.value) and s.value > 0]
        rates = [s.value for s in rate if math.isfinite(s.value) and s.value > 0]
        return SpecCounters(
            engine="sglang", available=True,
            sglang_accept_length=sum(vals) / len(vals) if vals else math.nan,
            sglang_accept_rate=sum(rates) / len(rates) if rates else (math.nan if rate else None),
        )
    return SpecCounters(engine=engine, available=False)


def counters_delta(before: SpecCounters, after: SpecCounters) -> SpecCounters:
    """`after - before` for vLLM's cumulative counters (what happened between two scrapes).

    SGLang's gauges are not differenced: the delta carries `after`'s gauge values. A counter that
    went down (the server restarted between the scrapes) is a ValueError."""
    if not after.available:
        return SpecCounters(engine=after.engine, available=False)
    if after.engine == "sglang":
        return SpecCounters(engine="sglang", available=True, sglang_accept_length=after.sglang_accept_length,
                            sglang_accept_rate=after.sglang_accept_rate)
    b = before if before.available else SpecCounters(engine=after.engine, available=True)
    k = max(len(b.accepted_per_pos), len(after.accepted_per_pos))
    bp = list(b.accepted_per_pos) + [0.0] * (k - len(b.accepted_per_pos))
    ap = list(after.accepted_per_pos) + [0.0] * (k - len(after.accepted_per_pos))
    out = SpecCounters(
        engine=after.engine, available=True,
        drafts=after.drafts - b.drafts, draft_tokens=after.draft_tokens - b.draft_tokens,
        accepted=after.accepted - b.accepted, accepted_per_pos=[x - y for x, y in zip(ap, bp)],
    )
    if min([out.drafts, out.draft_tokens, out.accepted] + out.accepted_per_pos, default=0.0) < 0:
        raise ValueError("the server's spec-decode counters went down between two scrapes "
                         "(the server restarted?); run the benchmark again")
    return out

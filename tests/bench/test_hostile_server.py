"""specjax.bench against a misbehaving server (tests/bench/_hostile_server.py, and the fake vLLM of
_fake_server.py with tampered counters), all on 127.0.0.1 and bounded in bytes and time:

* a whole-request deadline that a server trickling keep-alive lines, tokens or header bytes cannot
  extend (the request fails within the deadline plus slack, and is counted), and the idle bound;
* a stream that ends without `data: [DONE]` (closed, chunked end, cut chunk, cut event) is a failed
  request, not a full reply; events that are not JSON objects or nest 100,000 deep fail the request;
* 200 MB replies (many events, one endless line, an error body) read in a child process under
  RLIMIT_AS: the client stops at its cap, its memory does not grow, results.json stays small;
* a /metrics page with position="10000000" (child under RLIMIT_AS): that level's acceptance is
  unavailable with the reason, in bounded time and memory;
* NaN / +Inf counters and counters that go down (a restart) during level 2 of 3: levels 1 and 3
  are measured exactly, level 2 keeps its requests and says why its acceptance is unavailable;
* results written per level: a bench killed (SIGKILL) or interrupted (SIGINT) in level 2 leaves
  level 1 on disk, with a status saying the run did not finish."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fake_server import DEFAULT_INCREMENTS, FakeServer  # noqa: E402
from _hostile_server import POSITION_BOMB_PAGE, HostileServer  # noqa: E402

from specjax.bench import cli, client, core  # noqa: E402
from specjax.bench.client import Endpoint, stream_request  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = 1 << 20  # the reply cap at max_tokens 16: client.default_max_reply_bytes(16)
HEADROOM = 512 << 20  # address space a child may add after its imports


def _ask(srv, what, **kw):
    t = time.monotonic()
    rec = stream_request(Endpoint.parse(srv.url), "m", messages=[{"role": "user", "content": what}], max_tokens=16,
                         **kw)
    return rec, time.monotonic() - t


# ---------------------------------------------------------------------------------------------
# the whole-request deadline


@pytest.mark.parametrize("what", ["keepalive", "slow-tokens", "slow-headers"])
def test_a_trickling_server_cannot_extend_the_deadline(what):
    with HostileServer(limit_s=12.0, tick_s=0.2) as srv:
        rec, dt = _ask(srv, what, timeout=1.5)
    assert not rec["ok"] and rec["error"] == "no complete reply within 1.5 s (--request-timeout)", rec
    assert 1.4 <= dt < 3.5, dt  # the server would have gone on for 12 s, a byte every 0.2 s


def test_idle_bound_and_the_default_deadline():
    with HostileServer(limit_s=8.0) as srv:
        rec, dt = _ask(srv, "silent", timeout=10.0, idle_timeout=0.5)
        assert rec["error"] == "the server sent nothing for 0.5 s (--idle-timeout)" and dt < 2.5, (rec, dt)
        rec, dt = _ask(srv, "silent", timeout=1.0)
        assert rec["error"] == "no complete reply within 1 s (--request-timeout)" and dt < 2.5, (rec, dt)
        rec, _ = _ask(srv, "ok")
        assert rec["ok"] and rec["text"] == "a b c" and rec["output_tokens"] == 3, rec
    # the default: a max_tokens reply at 2 tokens/s plus a minute, not the old flat 600 s
    assert client.default_request_timeout(256) == 188.0 and client.default_request_timeout(16) == 68.0
    assert client.default_max_reply_bytes(16) == CAP and client.default_max_reply_bytes(1024) == 4 << 20
    assert cli.build_parser().parse_args(["--url", "x"]).request_timeout is None


# ---------------------------------------------------------------------------------------------
# a stream is complete only with [DONE]


@pytest.mark.parametrize("what,error", [
    ("no-done", "stream ended before [DONE] after 3 tokens"),
    ("no-done-chunked", "stream ended before [DONE] after 3 tokens"),
    ("cut-chunk", "stream ended before [DONE] after 3 tokens (IncompleteRead)"),
    ("mid-event", "stream ended before [DONE] after 2 tokens (the last event was cut in the middle)"),
])
def test_a_stream_without_done_is_a_failed_request(what, error):
    with HostileServer() as srv:
        rec, dt = _ask(srv, what, timeout=10.0)
    assert not rec["ok"] and rec["error"] == error, rec
    assert rec["text"] == "" and dt < 5.0


@pytest.mark.parametrize("what,error", [("deep-json", "bad event: b'[[[["),
                                        ("not-object", "bad event (not a JSON object): b'[1, 2, 3]'")])
def test_bad_events_fail_the_request(what, error):
    with HostileServer() as srv:
        rec, _ = _ask(srv, what, timeout=10.0)
    assert not rec["ok"] and rec["error"].startswith(error), rec


# ---------------------------------------------------------------------------------------------
# huge replies: a child process under a hard address-space bound

_BOUND = f"""
import json, resource, sys
def peak_kib():  # this process's own peak RSS (ru_maxrss would include the forking test process's)
    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize:")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + {HEADROOM}, resource.getrlimit(resource.RLIMIT_AS)[1]))
rss0 = peak_kib()
"""

_STREAM_CHILD = "from specjax.bench.client import Endpoint, stream_request\n" + _BOUND + """
rec = stream_request(Endpoint.parse(sys.argv[1]), "m", messages=[{"role": "user", "content": sys.argv[2]}],
                     max_tokens=16, timeout=60)
print(json.dumps({"ok": rec["ok"], "error": rec["error"], "text": len(rec["text"]), "bytes": rec.get("reply_bytes"),
                  "growth_kb": peak_kib() - rss0}))
"""


def _child(code, *args, timeout=60):
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.parametrize("what", ["huge-events", "huge-line", "huge-error"])
def test_a_200_mb_reply_is_cut_at_the_cap_in_bounded_memory(what):
    with HostileServer(huge_bytes=200 << 20, limit_s=30.0) as srv:
        res = _child(_STREAM_CHILD, srv.url, what)
        time.sleep(0.2)  # let the server notice the hang-up
        sent = srv.bytes_sent.get(what, 0)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out["ok"] and out["text"] == 0, out
    if what == "huge-error":
        assert out["error"].startswith("HTTP 500: xxxx") and len(out["error"]) < 600, out
    else:
        assert out["error"] == f"reply exceeded {CAP} bytes (--max-reply-bytes)", out
        assert CAP < out["bytes"] <= CAP + (64 << 10), out
    assert out["growth_kb"] < 48 * 1024, out  # the old client held the whole reply: hundreds of MB
    assert sent < 64 << 20, sent  # the client hung up instead of draining 200 MB


_CLI_CHILD = "import specjax.bench.cli as cli, specjax.data.datasets\n" + _BOUND + """
rc = cli.main(sys.argv[1:])
print("growth_kb", peak_kib() - rss0, file=sys.stderr)
sys.exit(rc)
"""


def _write_prompts(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n")


def test_cli_counts_misbehaving_replies_and_keeps_results_small(tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    _write_prompts(prompts, ["ok", "huge-events", "keepalive", "no-done", "huge-line", "mid-event", "ok"])
    with HostileServer(huge_bytes=200 << 20, limit_s=20.0, metrics_page="") as srv:
        t = time.monotonic()
        res = _child(_CLI_CHILD, "--url", srv.url, "--prompts", str(prompts), "--concurrency", "1",
                     "--max-tokens", "16", "--request-timeout", "1.5", "--warmup", "0", "--no-progress",
                     "--no-plots", "--out", str(out))
        dt = time.monotonic() - t
    assert res.returncode == 1, res.stderr[-3000:]  # failed requests: exit 1, results written
    assert "5 request(s) failed" in res.stderr and dt < 30, (dt, res.stderr[-2000:])
    growth = int(re.search(r"growth_kb (\d+)", res.stderr).group(1))
    assert growth < 96 * 1024, growth
    assert os.path.getsize(out / "results.json") < 256 << 10
    results = json.load(open(out / "results.json"))
    assert results["status"] == "complete"
    assert results["limits"] == {"request_timeout_s": 1.5, "idle_timeout_s": None, "max_reply_bytes": CAP}
    (lv,) = results["arms"]["spec"]["levels"]
    errors = {r["job_id"]: r["error"] for r in lv["requests"]}
    assert lv["summary"]["ok"] == 2 and lv["summary"]["failed"] == 5
    assert sorted(e for e in errors.values() if e) == sorted([
        f"reply exceeded {CAP} bytes (--max-reply-bytes)", f"reply exceeded {CAP} bytes (--max-reply-bytes)",
        "no complete reply within 1.5 s (--request-timeout)", "stream ended before [DONE] after 3 tokens",
        "stream ended before [DONE] after 2 tokens (the last event was cut in the middle)"])
    assert all(len(r["text"]) <= CAP for r in lv["requests"])


# ---------------------------------------------------------------------------------------------
# /metrics: a position of 10^7, NaN / Inf, counters that go down

_METRICS_CHILD = "from specjax.bench import core\nfrom specjax.bench.client import Endpoint\n" + _BOUND + """
jobs = [core.BenchJob(f"q{i}", "x", ("ok",)) for i in range(6)]
res = core.run_level(Endpoint.parse(sys.argv[1]), "m", jobs, 1, max_tokens=4)
s = core.summarize_level(res)
growth_kb = peak_kib() - rss0
print(json.dumps({"ok": s["ok"], "acceptance": s["acceptance"], "why": s["acceptance_unavailable"],
                  "errors": res["scrape_errors"], "growth_kb": growth_kb}))
"""


def test_metrics_position_bomb_is_refused_in_bounded_time_and_memory():
    reads = [0]

    def page():
        reads[0] += 1
        return POSITION_BOMB_PAGE

    with HostileServer(metrics_page=page) as srv:
        t = time.monotonic()
        res = _child(_METRICS_CHILD, srv.url, timeout=60)
        dt = time.monotonic() - t
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] == 6 and out["acceptance"] is None, out  # the requests are measured all the same
    bomb = "has a sample with position='10000000', not a draft position 0..1023"
    assert out["why"].startswith("/metrics failed 5 times in a row, no more scrapes in this level")
    assert bomb in out["why"]
    assert all(bomb in e for e in out["errors"]) and len(out["errors"]) == 5
    assert reads[0] == 5  # it stopped reading the page
    assert out["growth_kb"] < 48 * 1024 and dt < 20, (out, dt)


class TamperedServer(FakeServer):
    """The fake vLLM whose counters go bad while `mode` is set: "NaN" / "+Inf" (the drafts counter of
    engine 0 reads so), or "restart" (every counter back to 0 before the next request's increment)."""
    mode = None

    def metrics_text(self):
        text = super().metrics_text()
        if self.mode in ("NaN", "+Inf"):
            text = re.sub(r'^(vllm:spec_decode_num_drafts_total\{engine="0"[^}]*\}) \S+$', rf"\1 {self.mode}", text,
                          flags=re.M)
        return text

    def advance(self, tag):
        if self.mode == "restart":
            with self.lock:
                self.drafts = self.draft_tokens = self.accepted = 0
                self.per_pos = [0] * self.k
            self.mode = None
        super().advance(tag)


@pytest.mark.parametrize("mode,why", [
    ("NaN", "vllm:spec_decode_num_drafts_total is nan (a counter is a finite number >= 0)"),
    ("+Inf", "vllm:spec_decode_num_drafts_total is inf (a counter is a finite number >= 0)"),
    ("restart", "the server's spec-decode counters went down between two scrapes"),
])
def test_bad_counters_in_level_two_keep_levels_one_and_three(mode, why, tmp_path, monkeypatch, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    _write_prompts(prompts, [f"prompt p{i}" for i in range(4)])
    run_level = core.run_level
    with TamperedServer(ttft_s=0.005, gap_s=0.002) as srv:
        def level_with_bad_counters(ep, model, jobs, c, **kw):
            srv.mode = mode if c == 2 else None
            try:
                return run_level(ep, model, jobs, c, **kw)
            finally:
                srv.mode = None

        monkeypatch.setattr(core, "run_level", level_with_bad_counters)
        rc = cli.main(["--url", srv.url, "--prompts", str(prompts), "--concurrency", "1,2,4", "--max-tokens", "9",
                       "--no-progress", "--no-plots", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    results = json.load(open(out / "results.json"))
    levels = results["arms"]["spec"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 4]
    drafts = sum(DEFAULT_INCREMENTS[t][0] for t in range(4))
    accepted = sum(sum(DEFAULT_INCREMENTS[t][1]) for t in range(4))
    for lv in levels:
        s = lv["summary"]
        assert s["ok"] == 4 and s["output_tokens"] == 36  # every level's requests are kept
        if lv["concurrency"] == 2:
            assert s["acceptance"] is None and why in s["acceptance_unavailable"], s["acceptance_unavailable"]
        else:
            assert s["acceptance_unavailable"] is None
            assert s["acceptance"]["drafts"] == drafts and s["acceptance"]["accepted"] == accepted
    assert "warning: spec c=2: acceptance unavailable: " in err
    md = open(out / "results.md").read()
    assert "| spec | 2 | – | unavailable: " in md and why.replace("|", "/") in md


# ---------------------------------------------------------------------------------------------
# results written per level


def _start_bench_with_a_stalled_level_two(srv, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    _write_prompts(prompts, [f"prompt p{i}" for i in range(3)])
    proc = subprocess.Popen([sys.executable, "-m", "specjax.bench", "--url", srv.url, "--prompts", str(prompts),
                             "--concurrency", "1,2", "--max-tokens", "9", "--warmup", "0", "--no-progress",
                             "--no-plots", "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            preexec_fn=_default_sigint)
    t_end = time.monotonic() + 60
    while len(srv.bodies) < 4:  # level 1 is requests 1-3; the 4th is level 2's first, which stalls
        assert proc.poll() is None and time.monotonic() < t_end, proc.communicate(timeout=5)
        time.sleep(0.05)
    return proc, out


def _default_sigint():
    """In the bench's child before exec: SIGINT unblocked and at its default disposition, whatever the
    test process inherited (a CI run once saw the child finish level 2 and exit 0 after the SIGINT,
    as if it never arrived; a blocked or ignored SIGINT in the parent would do that)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_state(pid: int) -> str:
    """The child's signal masks (/proc/PID/status: SigBlk, SigIgn, SigCgt; SIGINT is bit 1, 0x2), for a
    failure message."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return f"(no /proc status: {e})"


def _stalling_server(release):
    def reply(text, body):
        if len(server.bodies) > 3:
            release.wait(30)
        return "one two three"

    server = FakeServer(ttft_s=0.0, gap_s=0.0, reply=reply)
    return server


def _check_level_one(results):
    (lv,) = results["arms"]["spec"]["levels"]
    assert lv["concurrency"] == 1 and lv["summary"]["ok"] == 3 and len(lv["requests"]) == 3
    assert lv["summary"]["acceptance"]["drafts"] == sum(DEFAULT_INCREMENTS[t][0] for t in range(3))


def test_a_bench_killed_in_level_two_leaves_level_one_on_disk(tmp_path):
    release = threading.Event()
    with _stalling_server(release) as srv:
        proc, out = _start_bench_with_a_stalled_level_two(srv, tmp_path)
        try:
            results = json.load(open(out / "results.json"))  # written before level 2 began
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            proc.kill()
            release.set()
    assert results["status"] == "running" and "python -m specjax.bench" in results["command"]
    _check_level_one(results)
    assert json.load(open(out / "results.json")) == results  # the kill changed nothing
    assert "**Incomplete run** (saved while it ran; if it runs no more, it ended before finishing): 1 finished " \
           "level(s)" in open(out / "results.md").read()


def test_a_bench_interrupted_in_level_two_saves_why(tmp_path):
    release = threading.Event()
    with _stalling_server(release) as srv:
        proc, out = _start_bench_with_a_stalled_level_two(srv, tmp_path)
        try:
            state = _signal_state(proc.pid)
            proc.send_signal(signal.SIGINT)
            # a guard against a hang, not a speed bound: on 2 busy cores the save took over 20 s twice
            _, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
            release.set()
    assert proc.returncode == 130, f"child's signal state before the SIGINT: {state}\n{err[-2000:]}"
    assert "/results.json (status 'stopped: interrupted (Ctrl-C)')" in err
    results = json.load(open(out / "results.json"))
    assert results["status"] == "stopped: interrupted (Ctrl-C)"
    _check_level_one(results)
    assert "**Incomplete run** (stopped: interrupted (Ctrl-C))" in open(out / "results.md").read()

"""A stand-in for the benchmark process in tests/bench/test_sandbox_hostile.py: checks one reply with
`task_accuracy.check_reply` in a process of its own (so a program that kills its parent, or floods
stderr, can only hurt this process) and prints one JSON line: the verdict and this process's peak
resident memory (KiB) before and after the check.

stdin: {"problem": {Problem fields}, "reply": str, "timeout_s": float}."""
import json
import resource
import sys

from specjax.eval import task_accuracy as ta


def main() -> int:
    job = json.load(sys.stdin)
    before = int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])
    verdict = ta.check_reply(ta.Problem(**job["problem"]), job["reply"], job["timeout_s"])
    after = int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])
    print(json.dumps({"verdict": verdict.to_dict(), "maxrss_before_kib": before, "maxrss_after_kib": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

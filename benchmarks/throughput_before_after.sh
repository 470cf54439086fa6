#!/usr/bin/env bash
# The train step's speed before and after a change, side by side on one GPU in one call:
# benchmarks/train_throughput.py (specjax only, fixed_4096) from an archive of the earlier checkout
# and from this tree, alternating before / after ROUNDS times, each run in its own process.
#   usage: benchmarks/throughput_before_after.sh BEFORE.tar.gz OUT_DIR [ROUNDS] [MODELS]
#   e.g.   git archive --format=tar.gz -o base.tgz <rev> -- specjax kernels converters benchmarks pyproject.toml
# The per-run JSON rows land in OUT_DIR/{before,after}_<round>/; the table: benchmarks/results/*.md.
set -euo pipefail
archive=$1
out=$2
rounds=${3:-1}
models=${4:-llama3_8b,qwen3_30b_a3b}
here=$(cd "$(dirname "$0")/.." && pwd)
before=$(mktemp -d)
tar -xzf "$archive" -C "$before"
mkdir -p "$out"
run() {  # name, repo root
  (cd "$2" && PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$2/kernels:$2/converters:$2 JAX_PLATFORMS=cuda \
    python3 benchmarks/train_throughput.py --models "$models" --systems specjax --jobs fixed_4096 --steps 5 \
      --no-maxlen --no-profile --worker-timeout-s 200 --out "$out/$1") 2>&1 | tee "$out/$1.log" | grep -E "tok/s|error|Error" || true
}
for r in $(seq 1 "$rounds"); do
  run "before_$r" "$before"
  run "after_$r" "$here"
done

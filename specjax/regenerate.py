"""Regenerate the assistant turns of a chat dataset with the target's own answers.

EAGLE drafts learn best on text the target itself generates. For every conversation the trailing
assistant turn(s) are dropped (the system/user/... context and earlier assistant turns stay), the
target answers, and its answer becomes the new last turn. With `--turns all` (config
`regenerate.turns: all`) every turn is answered in order instead, each after the target's own earlier
answers, and none of the source's answers stays (`regen.common.answer_every_turn`); when a later
prompt must drop older exchanges to fit `max_prompt_tokens`, the conversation as it stood is written
as a row of its own first (a "window"), so every answer the target gave is trained on. Output: parquet shards
`shard-NNNNNN.parquet` (columns `messages`, `source_index`) plus `manifest.json`, a directory that
`data.train_files` can point at.

    python -m specjax.regenerate --input preset://sharegpt --limit 2000 --out data/regen \\
        --backend jax --target DIR [--temperature 0 --max-new-tokens 512]
    python -m specjax.regenerate --input chats.jsonl --out data/regen --backend openai \\
        --endpoint http://127.0.0.1:8000/v1 --model NAME [--concurrency 32] [--resume]
    python -m specjax.regenerate --config configs/X.yaml [key=value ...]   # the `regenerate` section

Interrupted runs continue with `--resume` (finished shards are kept); a resume with settings
that change the output is refused, naming them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator

from specjax.regen.common import (LOGGER_NAME, ConversationFlow, Item, RegenerateError, Redactor, answer_every_turn,
                                  prompt_messages)
from specjax.regen.inputs import canonical_input, input_files, iter_rows
from specjax.regen.output import (fingerprint_files, finished_shards, prepare_output_dir, read_shard_stats, shard_name,
                                  write_shard)
from specjax.run_files import REGENERATED_DIR

__all__ = ["regenerate", "run_from_config", "Summary", "RegenerateError", "main"]

log = logging.getLogger(LOGGER_NAME)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specjax")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


@dataclasses.dataclass
class Summary:
    out_dir: str
    rows_in: int = 0  # rows read from the input (good and bad)
    conversations: int = 0  # rows with a turn to answer (after --limit)
    written: int = 0  # rows in the output, all shards
    written_this_run: int = 0
    skipped: dict = dataclasses.field(default_factory=dict)  # reason -> rows
    tokens_generated: int = 0  # this run
    truncated: int = 0  # answers cut by max_new_tokens (kept)
    shortened: int = 0  # prompts whose oldest turns were dropped to fit (long_prompts=drop_oldest_turns)
    turns_answered: int = 0  # assistant turns answered, all shards (turns="all": several per conversation)
    # turns="all": rows that are a finished window of a conversation whose later prompt dropped older
    # turns (regen.common.Conversation.windows); its answers kept in that prompt are in both rows
    windows: int = 0
    cut: dict = dataclasses.field(default_factory=dict)  # turns="all": reason -> conversations ended early
    shards_written: int = 0
    shards_resumed: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["wall_s"] = round(d["wall_s"], 2)
        return d


def _count(d: dict, key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


def _items(source: str, limit: int | None, summary: Summary, row_limits=None) -> Iterator[Item]:
    for row in iter_rows(source, row_limits):
        if limit is not None and summary.conversations >= limit:
            return
        summary.rows_in += 1
        if row.error is not None:
            _count(summary.skipped, getattr(row.error, "kind", "bad row"))
            log.debug("skipping %s", row.error)
            continue
        prompt = prompt_messages(row.messages)
        if prompt is None:
            _count(summary.skipped, "no user turn to answer")
            continue
        summary.conversations += 1
        yield Item(int(row.index), tuple(prompt))


def _chunks(items: Iterator[Item], size: int) -> Iterator[list[Item]]:
    chunk: list[Item] = []
    for it in items:
        chunk.append(it)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def regenerate(
    *,
    input: str,
    out_dir: str,
    backend: str = "jax",
    target: str | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    model: str | None = None,
    endpoint: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    extra_body: dict | None = None,
    limit: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int = 0,
    batch_size: int = 16,
    segment_steps: int = 16,
    max_prompt_tokens: int = 1024,
    long_prompts: str = "skip",
    concurrency: int = 8,
    timeout_s: float = 600.0,
    max_retries: int = 3,
    backoff_base_s: float = 1.0,
    shard_size: int = 1000,
    keep_reasoning: bool = True,
    resume: bool = False,
    generate_fn: Callable | None = None,
    turns: str = "last",
    decode_attention: str = "auto",
    row_limits=None,
    template_limits=None,
    template_variables=None,
) -> Summary:
    """Run the stage; see the module docstring. Unset sampling values come from the target's
    generation_config.json (jax back end), else greedy with 512 new tokens. ``row_limits`` (a
    `specjax.data.sources.RowLimits`) make the input's oversized rows counted skips;
    ``template_limits`` (a `specjax.data.chat.TemplateLimits`) bound each rendering of the chat
    template (jax back end). Both default to the config defaults. ``template_variables``
    (`data.chat_template_kwargs`) go to every rendering: the jax back end's, and the openai back end's
    server as the request's ``chat_template_kwargs`` (unless ``extra_body`` sets that key itself)."""
    t0 = time.time()
    if backend not in ("jax", "openai"):
        raise RegenerateError(f"unknown back end {backend!r}: use jax or openai")
    if turns not in ("last", "all"):
        raise RegenerateError(f"turns must be 'last' (answer the final turn, keep the source's earlier answers) "
                              f"or 'all' (answer every turn in order), got {turns!r}")
    if shard_size <= 0:
        raise RegenerateError(f"shard_size must be positive, got {shard_size}")
    if segment_steps <= 0:
        raise RegenerateError(f"segment_steps must be positive, got {segment_steps}")
    if limit is not None and limit <= 0:
        raise RegenerateError(f"limit must be positive, got {limit}")
    template_variables = dict(template_variables or {})
    if backend == "openai" and template_variables and "chat_template_kwargs" not in (extra_body or {}):
        extra_body = {**(extra_body or {}), "chat_template_kwargs": template_variables}
    key = os.environ.get(api_key_env) if backend == "openai" else None
    redactor = Redactor(key, urllib.parse.urlsplit(endpoint).password if endpoint else None)
    log.addFilter(redactor)
    from specjax.data.chat import ChatTemplateUnusable

    try:
        return _run(**locals())
    except RegenerateError:
        raise
    except ChatTemplateUnusable as e:  # e.g. a rendering past a limit: the template's problem, one line
        raise RegenerateError(str(e)) from e
    except Exception as e:  # never let the key through in an unexpected error's text
        text = str(e)
        if redactor.redact(text) != text:
            raise RegenerateError(f"{type(e).__name__}: {redactor.redact(text)}") from None
        raise
    finally:
        log.removeFilter(redactor)


def _run(*, t0, redactor, key, **a) -> Summary:
    from specjax.regen.client import public_endpoint

    from specjax.data.sources import RowLimits

    source = canonical_input(a["input"])
    out_dir = os.path.abspath(a["out_dir"])
    row_limits = RowLimits(*(a["row_limits"] or RowLimits()))
    backend = a["backend"]

    if backend == "jax":
        if not a["target"]:
            raise RegenerateError("the jax back end needs the target folder: --target DIR (config: target.path)")
        if not os.path.isfile(os.path.join(a["target"], "config.json")):
            raise RegenerateError(f"target folder {a['target']!r} has no config.json; give a Hugging Face model folder")
        from specjax.regen.jax_backend import generation_defaults

        defaults = generation_defaults(a["target"])
        model_id = os.path.abspath(a["target"])
    else:
        if not a["model"]:
            raise RegenerateError("the openai back end needs a model name: --model NAME (config: regenerate.model)")
        defaults, model_id = {}, a["model"]
    temperature = float(a["temperature"] if a["temperature"] is not None else defaults.get("temperature", 0.0))
    top_p = float(a["top_p"] if a["top_p"] is not None else defaults.get("top_p", 1.0))
    max_new = int(a["max_new_tokens"] if a["max_new_tokens"] is not None else defaults.get("max_new_tokens", 512))
    if temperature < 0 or not 0 < top_p <= 1 or max_new <= 0:
        raise RegenerateError(f"bad sampling settings: temperature={temperature} (>= 0), top_p={top_p} "
                              f"(in (0, 1]), max_new_tokens={max_new} (> 0)")

    manifest = {
        "format": 1,
        "input": source,
        "limit": a["limit"],
        "backend": backend,
        "model": model_id,
        "temperature": temperature,
        "top_p": top_p,
        "seed": int(a["seed"]),
        "max_new_tokens": max_new,
        "max_prompt_tokens": int(a["max_prompt_tokens"]) if backend == "jax" else None,
        "long_prompts": a["long_prompts"] if backend == "jax" else None,
        "shard_size": int(a["shard_size"]),
        "keep_reasoning": bool(a["keep_reasoning"]),
        "extra_body": dict(a["extra_body"] or {}) if backend == "openai" else None,
        "chat_template_kwargs": a["template_variables"] if backend == "jax" else None,
        # information only
        "endpoint": public_endpoint(a["endpoint"]) if backend == "openai" and a["endpoint"] else None,
        "api_key_env": a["api_key_env"] if backend == "openai" else None,
        "chat_template": "data.chat_template" if a["chat_template"] else "the tokenizer's own",
        "specjax_version": _version(),
        "columns": ["messages", "source_index"],
        "turns": a["turns"],
        "max_row_bytes": row_limits.max_bytes,
        "max_row_depth": row_limits.max_depth,
        # the source's content: a resume whose source files differ is refused (regen.output)
        "input_files": fingerprint_files(input_files(source)),
    }
    manifest = json.loads(redactor.redact(json.dumps(manifest)))
    resumed = prepare_output_dir(out_dir, manifest, a["resume"])
    done = finished_shards(out_dir)
    log.info("regenerating %s -> %s (%s back end, model %s%s)", source, out_dir, backend, model_id,
             f"; resuming, {len(done)} shard(s) done" if resumed else "")

    summary = Summary(out_dir=out_dir)
    all_turns = a["turns"] == "all"
    chunks = list(enumerate(_chunks(_items(source, a["limit"], summary, row_limits), int(a["shard_size"]))))
    todo = []
    for k, chunk in chunks:
        if k in done:
            _count_resumed(summary, read_shard_stats(os.path.join(out_dir, shard_name(k))))
        else:
            todo.append((k, chunk))
    if todo:  # load the model / open the client only when there is work
        engine = _make_backend(a, temperature=temperature, top_p=top_p, max_new=max_new, redactor=redactor)
        if hasattr(engine, "run_flows"):
            # every shard's conversations through one continuous batch; a shard is written as soon as
            # its last conversation ends (its requests go first: priority = shard number)
            waiting: dict[int, list] = {}

            def flows():
                for k, chunk in todo:
                    made = [ConversationFlow(it, all_turns) for it in chunk]
                    waiting[k] = [chunk, made, len(made)]
                    for i, f in enumerate(made):
                        yield (k, i), f, (k,)

            def finished(key, _flow):
                entry = waiting[key[0]]
                entry[2] -= 1
                if entry[2] == 0:
                    del waiting[key[0]]
                    _write(out_dir, key[0], entry[0], [f.conversation for f in entry[1]], summary, t0)

            stats = engine.run_flows(flows(), finished)
            log.info("generation: %s", json.dumps(stats))
            if waiting:
                raise RuntimeError(f"shards {sorted(waiting)} did not finish")
        else:
            for k, chunk in todo:
                _write(out_dir, k, chunk, answer_every_turn(engine.answer, chunk, all_turns), summary, t0)
    if summary.conversations == 0:
        log.warning("the input %s has no conversation with a turn to answer (skipped %s)", source, summary.skipped)
    summary.wall_s = time.time() - t0
    log.info("regeneration done: %s", json.dumps(summary.as_dict()))
    return summary


def _count_resumed(summary: Summary, st: dict) -> None:
    """Add a finished shard's stats (from an earlier run) to the summary."""
    summary.shards_resumed += 1
    summary.written += int(st.get("written", 0))
    summary.turns_answered += int(st.get("turns_answered", st.get("written", 0)))
    summary.windows += int(st.get("windows", 0))
    summary.truncated += int(st.get("truncated", 0))
    summary.shortened += int(st.get("shortened", 0))
    for r, n in (st.get("skipped") or {}).items():
        _count(summary.skipped, r, int(n))
    for r, n in (st.get("cut") or {}).items():
        _count(summary.cut, r, int(n))


def _write(out_dir: str, k: int, chunk: list[Item], convs: list, summary: Summary, t0: float) -> None:
    """Write shard k from its conversations' results and count them in the summary."""
    rows, skipped, cut = [], {}, {}
    tokens = truncated = shortened = turns = windows = 0
    for it, conv in zip(chunk, convs):
        tokens += conv.new_tokens
        if conv.messages is None:
            _count(skipped, conv.skip_reason or "no answer")
            continue
        truncated += conv.truncated
        shortened += int(conv.shortened)
        turns += conv.turns
        if conv.cut_reason:
            _count(cut, f"turn {conv.turns + 1} of {conv.rounds}: {conv.cut_reason}")
        windows += len(conv.windows)
        rows.extend((m, it.source_index) for m in conv.rows())
    write_shard(out_dir, k, rows, {"written": len(rows), "skipped": skipped, "tokens_generated": tokens,
                                   "truncated": truncated, "shortened": shortened, "turns_answered": turns,
                                   "cut": cut, "windows": windows})
    summary.shards_written += 1
    summary.written += len(rows)
    summary.written_this_run += len(rows)
    summary.tokens_generated += tokens
    summary.truncated += truncated
    summary.shortened += shortened
    summary.turns_answered += turns
    summary.windows += windows
    for r, n in skipped.items():
        _count(summary.skipped, r, n)
    for r, n in cut.items():
        _count(summary.cut, r, n)
    log.info("shard %d: %d rows written, %d skipped, %d tokens (%.1f s so far)", k, len(rows),
             sum(skipped.values()), tokens, time.time() - t0)


def _make_backend(a: dict, *, temperature: float, top_p: float, max_new: int, redactor: Redactor):
    if a["backend"] == "openai":
        from specjax.regen.client import ChatClient, OpenAIBackend

        client = ChatClient(
            a["endpoint"], a["model"], api_key_env=a["api_key_env"], timeout_s=a["timeout_s"],
            max_retries=a["max_retries"], backoff_base_s=a["backoff_base_s"], extra_body=a["extra_body"],
            redactor=redactor,
        )
        return OpenAIBackend(client, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                             keep_reasoning=a["keep_reasoning"], concurrency=a["concurrency"])
    from transformers import AutoTokenizer

    from specjax.regen.jax_backend import JaxBackend, eos_token_ids
    from specjax.targets import load_target

    tok_path = a["tokenizer"] or a["target"]
    try:
        tok = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=a["trust_remote_code"])
    except (OSError, ValueError) as e:
        raise RegenerateError(f"cannot load the tokenizer from {tok_path!r}: {e}") from e
    from specjax.data.chat import ChatTemplateUnusable, check_chat_template

    try:  # before the target is loaded: a missing jinja2 is not a row's problem
        check_chat_template(tok, a["chat_template"], a["template_limits"], a["template_variables"])
    except ChatTemplateUnusable as e:
        raise RegenerateError(str(e)) from e
    target = load_target(a["target"], dtype=a["dtype"], decode_attention_implementation=a["decode_attention"])
    if len(tok) > target.config.vocab_size:
        raise RegenerateError(f"the tokenizer has {len(tok)} tokens but the target's vocab_size is "
                              f"{target.config.vocab_size}; use the target's own tokenizer")
    return JaxBackend(
        target, tok, chat_template=a["chat_template"], eos_ids=eos_token_ids(tok, a["target"]),
        max_new_tokens=max_new, temperature=temperature, top_p=top_p,
        max_prompt_tokens=a["max_prompt_tokens"], batch_size=a["batch_size"], seed=a["seed"],
        segment_steps=a["segment_steps"],
        keep_reasoning=a["keep_reasoning"], generate_fn=a["generate_fn"], long_prompts=a["long_prompts"],
        template_limits=a["template_limits"], template_variables=a["template_variables"],
    )


def output_dir(cfg) -> str:
    """Where the regeneration stage of `cfg` writes: `regenerate.out_dir`, else `<run.output_dir>/regenerated`."""
    return cfg.regenerate.out_dir or os.path.join(cfg.run.output_dir, REGENERATED_DIR)


def run_from_config(cfg) -> str:
    """Run the `regenerate.*` section of a `specjax.config.Config` (always resumable: a rerun
    continues, a changed setting is refused). Returns the output directory."""
    from specjax.data.chat import TemplateLimits
    from specjax.data.sources import RowLimits

    r = cfg.regenerate
    out_dir = output_dir(cfg)
    if r.backend == "jax" and cfg.target.build_demo and cfg.target.path:
        from specjax.demo import ensure_demo_target

        ensure_demo_target(cfg.target.path)
    summary = regenerate(
        input=r.source, out_dir=out_dir, backend=r.backend, target=cfg.target.path or None,
        tokenizer=cfg.data.tokenizer, chat_template=cfg.data.chat_template, dtype=cfg.target.dtype,
        trust_remote_code=cfg.target.trust_remote_code, model=r.model, endpoint=r.endpoint,
        api_key_env=r.api_key_env, limit=r.limit, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, seed=r.seed, batch_size=r.batch_size, segment_steps=r.segment_steps,
        max_prompt_tokens=r.max_prompt_tokens,
        long_prompts=r.long_prompts, concurrency=r.concurrency, timeout_s=r.timeout_s, max_retries=r.max_retries, shard_size=r.shard_size,
        keep_reasoning=r.keep_reasoning, resume=True, turns=r.turns, decode_attention=cfg.kernels.decode_attention,
        row_limits=RowLimits.of(cfg.data), template_limits=TemplateLimits.of(cfg.data),
        template_variables=cfg.data.chat_template_kwargs,
    )
    return summary.out_dir


# ------------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specjax.regenerate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run the `regenerate` section of this config (overrides as key=value)")
    p.add_argument("overrides", nargs="*", help="with --config: dotted overrides, e.g. regenerate.limit=100")
    p.add_argument("--input", help="preset://sharegpt, or a JSONL/JSON/parquet path")
    p.add_argument("--out", help="output directory (parquet shards + manifest.json)")
    p.add_argument("--backend", choices=("jax", "openai"), default="jax")
    p.add_argument("--limit", type=int, help="first N conversations with a turn to answer")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run into the same --out")
    p.add_argument("--shard-size", type=int, default=1000)
    p.add_argument("--turns", choices=("last", "all"), default="last",
                   help="last: answer each conversation's final turn (earlier answers are the source's); "
                        "all: answer every turn in order, each after the target's own earlier answers")
    g = p.add_argument_group("sampling (unset: the target's generation_config.json, else greedy)")
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    r = g.add_mutually_exclusive_group()
    r.add_argument("--keep-reasoning", dest="keep_reasoning", action="store_true", default=True,
                   help="store reasoning as a <think>...</think> prefix of the answer (default)")
    r.add_argument("--strip-reasoning", dest="keep_reasoning", action="store_false",
                   help="drop reasoning, keep the answer only")
    j = p.add_argument_group("jax back end")
    j.add_argument("--target", help="HF folder of the target (config.json + safetensors + tokenizer)")
    j.add_argument("--tokenizer", help="tokenizer folder (default: the target folder)")
    j.add_argument("--chat-template", help="Jinja template string or .jinja file (default: the tokenizer's)")
    j.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on CPU, else bfloat16")
    j.add_argument("--batch-size", type=int, default=16, help="cache rows (continuous batching)")
    j.add_argument("--segment-steps", type=int, default=16, help="decoding steps between refills of finished rows")
    j.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped (counted)")
    j.add_argument("--long-prompts", choices=("skip", "drop_oldest_turns"), default="skip",
                   help="a prompt over --max-prompt-tokens: skip it, or drop its oldest exchanges until it fits")
    j.add_argument("--trust-remote-code", action="store_true")
    o = p.add_argument_group("openai back end")
    o.add_argument("--endpoint", help="base URL, e.g. http://127.0.0.1:8000/v1")
    o.add_argument("--model", help="model name the server serves")
    o.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    o.add_argument("--concurrency", type=int, default=8)
    o.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o.add_argument("--max-retries", type=int, default=3)
    o.add_argument("--extra-body", help="JSON object merged into every request body, e.g. '{\"seed\": 0}'")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    # force: importing orbax (through specjax.config) lets absl call basicConfig() at WARNING first,
    # which would make this call a no-op and hide every shard's progress line and the summary
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    for noisy in ("absl", "jax._src", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.config:
            from specjax.config import ConfigError, load_config

            try:
                cfg = load_config(args.config, args.overrides)
            except ConfigError as e:
                print(f"config error: {e}", file=sys.stderr)
                return 2
            out = run_from_config(cfg)
            print(out)
            return 0
        if args.overrides:
            print("error: key=value overrides need --config", file=sys.stderr)
            return 2
        if not args.input or not args.out:
            print("error: give --input and --out (or --config)", file=sys.stderr)
            return 2
        extra = None
        if args.extra_body:
            try:
                extra = json.loads(args.extra_body)
            except json.JSONDecodeError as e:
                print(f"error: --extra-body is not JSON: {e}", file=sys.stderr)
                return 2
            if not isinstance(extra, dict):
                print("error: --extra-body must be a JSON object", file=sys.stderr)
                return 2
        dtype = args.dtype
        if dtype is None and args.backend == "jax":
            import jax

            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        summary = regenerate(
            input=args.input, out_dir=args.out, backend=args.backend, target=args.target,
            tokenizer=args.tokenizer, chat_template=args.chat_template, dtype=dtype or "float32",
            trust_remote_code=args.trust_remote_code, model=args.model, endpoint=args.endpoint,
            api_key_env=args.api_key_env, extra_body=extra, limit=args.limit,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            seed=args.seed, batch_size=args.batch_size, segment_steps=args.segment_steps,
            max_prompt_tokens=args.max_prompt_tokens,
            long_prompts=args.long_prompts,
            concurrency=args.concurrency, timeout_s=args.timeout, max_retries=args.max_retries,
            shard_size=args.shard_size, keep_reasoning=args.keep_reasoning, resume=args.resume,
            turns=args.turns,
        )
    except RegenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished shards are kept; rerun the same command with --resume", file=sys.stderr)
        return 130
    print(json.dumps(summary.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

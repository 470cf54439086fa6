"""On-policy regeneration during training (`regenerate.every_steps`): every N steps the target
re-answers the next `regenerate.slice_size` training prompts, and its answers replace those
prompts' examples in the training stream from the next step on.

Design: an in-memory pool of regenerated examples that *replaces* the original example of the same
training index (`RegenPool`), not a second source mixed beside the first. The stream keeps its
shape: the same shuffled, repeated list of training indices, packed the same way, so an epoch still
means one pass over the training prompts and data.train_file_weights still mixes the same groups;
only the conversation behind an index changes, to the target's newest answer to its prompt. A second
source would instead grow with every round and shift the mix toward the prompts answered so far.

Determinism across a stop: grain's packer restores by replaying its input from the start of the
last emitted batch, so the version an index resolves to cannot depend on when it is looked up. Each
round is therefore stamped with the stream position it takes effect at (`RegenPool.pulled`: how many
items the packer had drawn when the round ended); the k-th drawn item uses the newest version whose
stamp is <= k. Items drawn before the round (already in the packer's open rows) keep the old
example in an uninterrupted run and in a replay alike.

Resumable: `RegenStream` wraps the grain iterator; its checkpointed state is the grain position,
`pulled` and each applied round's number and stamp. The rounds' answers are parquet shards in
`<run.output_dir>/regen_rounds/` (`shard-NNNNNN.parquet`, NNNNNN = the round, written by
specjax.regen.output with a manifest of the settings), so a restore re-tokenizes them instead of
generating again, and a round redone after a kill that came before its checkpoint reuses its shard.

Turned off on resume (regenerate.every_steps=0 with checkpoint.allow_config_change): the stream keeps
the applied rounds' examples (read back from their shards like a resume with regeneration on) and runs
no new round; the run's data stream is a RegenStream whether or not it regenerates, and one that has
no round writes grain's own state, so a run that never regenerated saves what it saved before.

Held-out prompts never enter training: only the rows behind the training examples are read back as
prompts (one extra pass over the data files at start; the prompts' text then stays in memory beside
the token ids), and a training prompt whose turns equal a validation row's (a duplicate across the
split) is left out, counted in the log.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from specjax.checkpoint import CheckpointMismatch
from specjax.data.chat import (ChatTemplateUnusable, Example, SkipRow, TemplateLimits, resolve_chat_template,
                               tokenize_conversation)
from specjax.data.datasets import read_conversations
from specjax.data.sources import RowLimits
from specjax.regen.common import ConversationFlow, Item, Redactor, answer_every_turn, prompt_messages
from specjax.regen.output import finished_shards, prepare_output_dir, read_shard_stats, shard_name, write_shard
from specjax.run_files import REGEN_ROUNDS_DIR

__all__ = ["RegenPool", "RegenStream", "RegenRounds", "RoundResult", "make_regen_rounds", "check_regen_settings",
           "check_regen_steps", "training_prompts", "prompt_key", "STATE_FORMAT", "RegenShardMissing",
           "read_round_examples", "round_loader"]

log = logging.getLogger("specjax")

STATE_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# refusals, before anything loads
# ---------------------------------------------------------------------------------------------
def check_regen_settings(cfg, process_count: int = 1) -> None:
    """regenerate.every_steps > 0 with settings it cannot work with: a ValueError naming the fix."""
    r = cfg.regenerate
    if not r.every_steps:
        return
    if r.slice_size < 1:
        raise ValueError(f"regenerate.every_steps={r.every_steps} re-answers regenerate.slice_size training prompts "
                         f"a round, but slice_size={r.slice_size}. Fix: set regenerate.slice_size >= 1 (e.g. 256), "
                         "or regenerate.every_steps=0")
    if cfg.target.source == "cache":
        raise ValueError("regenerate.every_steps adds new examples during training, but target.source=cache trains "
                         "on the states precomputed for fixed rows (and does not load the target to answer with). "
                         "Fix: target.source=online, or regenerate.every_steps=0")
    if process_count > 1:
        raise ValueError("regenerate.every_steps runs in one process; with several processes set "
                         "regenerate.every_steps=0 (regenerate before training with python -m specjax.regenerate)")
    if r.backend == "openai" and not (r.model and r.endpoint):
        raise ValueError("regenerate.every_steps with regenerate.backend=openai needs regenerate.endpoint and "
                         "regenerate.model (the server that answers). Fix: set both, or regenerate.backend=jax")
    if r.turns == "all" and r.long_prompts == "drop_oldest_turns" and r.backend == "jax":
        raise ValueError("regenerate.every_steps replaces each training example by one regenerated conversation, but "
                         "turns=all with long_prompts=drop_oldest_turns can write several rows per conversation. "
                         "Fix: regenerate.long_prompts=skip, or regenerate.turns=last")


def check_regen_steps(cfg) -> None:
    """After train.steps is final: a round must fall before the last step (the last step has no next
    step to train on its answers)."""
    r = cfg.regenerate
    if r.every_steps and r.every_steps >= cfg.train.steps:
        raise ValueError(f"regenerate.every_steps={r.every_steps} >= train.steps={cfg.train.steps}: no round would "
                         f"run before the last step. Fix: regenerate.every_steps < {cfg.train.steps}, or 0 for off")


# ---------------------------------------------------------------------------------------------
# the prompts
# ---------------------------------------------------------------------------------------------
def prompt_key(prompt) -> tuple:
    """The turns a prompt asks the target about: its non-assistant messages as (role, content)."""
    return tuple((m["role"], m["content"]) for m in prompt if m["role"] != "assistant")


def training_prompts(cfg, prepared, files, val_files=()) -> tuple[list[Item], dict]:
    """The prompts of the training examples, in training order, as Items whose source_index is the
    example's index in `prepared.train`; and a count of those left out (reason -> n). Only the rows
    behind `prepared.train` are read back; a training prompt equal to a validation row's is left out."""
    train_at = {(ex.source, ex.row): i for i, ex in enumerate(prepared.train)}
    val_rows = {(ex.source, ex.row) for ex in prepared.val}
    limits = RowLimits.of(cfg.data)
    prompts: dict[int, list] = {}
    val_keys: set = set()
    left = len(train_at) + len(val_rows)
    for row in read_conversations(tuple(files) + tuple(val_files), limits=limits):
        if left == 0:
            break
        key = (str(row.source), int(row.index) + 1)
        if row.error is not None or (key not in train_at and key not in val_rows):
            continue
        left -= 1
        p = prompt_messages(row.messages)
        if key in train_at:
            prompts[train_at[key]] = p
        elif p is not None:
            val_keys.add(prompt_key(p))
    out, skipped = [], {}
    for i in range(len(prepared.train)):
        p = prompts.get(i)
        why = ("no user turn to answer" if p is None else
               "equal to a validation prompt" if prompt_key(p) in val_keys else None)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            out.append(Item(i, tuple(p)))
    return out, skipped


# ---------------------------------------------------------------------------------------------
# the pool and the stream
# ---------------------------------------------------------------------------------------------
class RegenPool:
    """Training index -> its regenerated versions, each from a stream position on (see the module doc).
    `current(k, (i, example))` is the grain map (map_with_index) over the drawn items."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._versions: dict[int, list[tuple[int, Example]]] = {}
        self.pulled = 0  # items drawn so far (the next item's k)
        self.rounds: list[dict] = []  # {"round", "from", "replaced"} of each applied round, in order

    def current(self, k: int, item):
        self.pulled = max(self.pulled, k + 1)
        i, ex = item
        for start, new in reversed(self._versions.get(i, ())):
            if k >= start:
                return i, new
        return item

    def apply(self, round_no: int, examples: dict[int, Example], start: Optional[int] = None) -> int:
        """Round `round_no`'s examples (training index -> example), in effect from stream position
        `start` (default: now). Returns how many indices it replaced."""
        start = self.pulled if start is None else int(start)
        for i, ex in examples.items():
            self._versions.setdefault(int(i), []).append((start, ex))
        self.rounds.append({"round": int(round_no), "from": start, "replaced": len(examples)})
        return len(examples)

    @property
    def examples_replaced(self) -> int:
        return sum(r["replaced"] for r in self.rounds)


class RegenShardMissing(CheckpointMismatch):
    """A checkpoint's data position names a regeneration round whose shard is gone (the checkpoint
    itself is sound, so it is not set aside as damaged)."""


class RegenStream:
    """The training iterator with a `RegenPool`: batches from the grain iterator; get_state/set_state
    (bytes, as grain's checkpoint handler takes from an iterator of its own kind) also hold the pool's
    rounds and position. `load_round(n) -> {index: example}` reads a round back on restore.
    `plain_when_empty` (a run with regenerate.every_steps=0): while no round is applied, get_state is
    the grain iterator's own state, as grain's handler writes it for a plain iterator."""

    def __init__(self, inner, pool: RegenPool, plain_when_empty: bool = False):
        self.inner, self.pool, self.plain_when_empty = inner, pool, plain_when_empty
        self.load_round: Optional[Callable[[int], dict]] = None

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.inner)

    def get_state(self) -> bytes:
        if self.plain_when_empty and not self.pool.rounds:
            return json.dumps(self.inner.get_state(), indent=4).encode()
        return json.dumps({"format": STATE_FORMAT, "inner": self.inner.get_state(), "pulled": self.pool.pulled,
                           "rounds": [{"round": r["round"], "from": r["from"]} for r in self.pool.rounds]}).encode()

    def set_state(self, state) -> None:
        s = json.loads(state)
        self.pool.reset()
        if "inner" not in s:  # saved by a run without regenerate.every_steps: no round yet
            self.inner.set_state(s)
            return
        if s.get("format") != STATE_FORMAT:
            raise ValueError(f"the checkpoint's data position has regeneration format {s.get('format')!r}, not "
                             f"{STATE_FORMAT}; resume it with the specjax that wrote it, or start fresh "
                             "(checkpoint.restore_from=none)")
        for r in s["rounds"]:
            if self.load_round is None:
                raise RuntimeError("RegenStream.load_round is not set: a checkpoint with regeneration rounds cannot "
                                   "be restored without it")
            self.pool.apply(r["round"], self.load_round(int(r["round"])), r["from"])
        self.inner.set_state(s["inner"])
        self.pool.pulled = int(s["pulled"])
        if self.pool.rounds:
            log.info("data position restored with %d regeneration round(s) applied (%d examples replaced)%s",
                     len(self.pool.rounds), self.pool.examples_replaced,
                     "; regenerate.every_steps=0: they are kept, no new round runs" if self.plain_when_empty else "")

    def start_prefetch(self) -> None:
        if hasattr(self.inner, "start_prefetch"):
            self.inner.start_prefetch()


# ---------------------------------------------------------------------------------------------
# the rounds
# ---------------------------------------------------------------------------------------------
@dataclass
class RoundResult:
    round: int
    step: int
    prompts: int  # prompts sent this round
    answered: int  # of them, answered (the rest: skipped by the backend, counted in `kept`)
    replaced: int  # training examples replaced
    tokens_generated: int
    kept: dict  # reason -> prompts whose original example stays
    reused: bool  # read back from a shard an earlier (killed) invocation wrote
    wall_s: float

    def metrics(self) -> dict:
        return {"round": self.round, "prompts": self.prompts, "answered": self.answered, "replaced": self.replaced,
                "tokens_generated": self.tokens_generated, "kept_original": sum(self.kept.values()),
                "reused_shard": int(self.reused), "wall_s": round(self.wall_s, 3)}


class RegenRounds:
    """Runs the rounds of one training run: answers a slice of `prompts`, writes it as a shard of
    <out_dir>/regen_rounds, tokenizes the answers like the training data and applies them to the
    stream's pool. `target` / `tokenizer`: the run's own (the jax backend answers in this process)."""

    def __init__(self, cfg, stream: RegenStream, prompts: list[Item], *, n_train: int, target, tokenizer,
                 out_dir: str, data_sha256: str):
        self.cfg, self.stream, self.prompts, self.n_train = cfg, stream, prompts, n_train
        self.target, self.tokenizer = target, tokenizer
        self.dir = os.path.join(out_dir, REGEN_ROUNDS_DIR)
        d = cfg.data
        self.template = resolve_chat_template(tokenizer, d.chat_template, TemplateLimits.of(d), d.chat_template_kwargs)
        if not prompts:
            raise ValueError("regenerate.every_steps: no training example has a prompt to re-answer (see the log "
                             "line above for why). Fix: regenerate.every_steps=0, or training data with user turns")
        if cfg.regenerate.backend == "jax":  # now, not after every_steps steps of training
            target.require_decoding()
        prepare_output_dir(self.dir, self._manifest(data_sha256), resume=True)
        stream.load_round = self.load_round

    def _manifest(self, data_sha256: str) -> dict:
        r, jax_backend = self.cfg.regenerate, self.cfg.regenerate.backend == "jax"
        return {
            "format": 1,
            "input": f"training prompts (data sha256 {data_sha256}), {r.slice_size} every {r.every_steps} steps",
            "limit": None, "backend": r.backend,
            "model": os.path.abspath(self.cfg.target.path) if jax_backend else r.model,
            "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed, "max_new_tokens": r.max_new_tokens,
            "max_prompt_tokens": r.max_prompt_tokens if jax_backend else None,
            "long_prompts": r.long_prompts if jax_backend else None, "shard_size": r.slice_size,
            "keep_reasoning": r.keep_reasoning, "extra_body": None if jax_backend else self._extra_body(),
            "chat_template_kwargs": dict(self.cfg.data.chat_template_kwargs) if jax_backend else None, "turns": r.turns,
            "max_row_bytes": self.cfg.data.max_row_bytes, "max_row_depth": self.cfg.data.max_row_depth,
            "columns": ["messages", "source_index"],
        }

    @property
    def rounds_done(self) -> int:
        return len(self.stream.pool.rounds)

    @property
    def examples_replaced(self) -> int:
        return self.stream.pool.examples_replaced

    def slice(self, round_no: int) -> list[Item]:
        """Round `round_no`'s prompts (from 1): the next slice_size, in order, wrapping (each at most once)."""
        n, size = len(self.prompts), self.cfg.regenerate.slice_size
        start = (round_no - 1) * size
        return [self.prompts[(start + j) % n] for j in range(min(size, n))]

    def run_round(self, step: int) -> RoundResult:
        t0 = time.time()
        round_no = self.rounds_done + 1
        path = os.path.join(self.dir, shard_name(round_no))
        reused = round_no in finished_shards(self.dir)
        if reused:  # a kill after this round's shard, before the checkpoint that applied it
            stats = read_shard_stats(path)
            log.info("regenerate round %d: %s was written before the restart; reusing it", round_no, path)
        else:
            stats = self._generate(round_no, path)
        examples, kept = self._examples(round_no, path)
        for reason, n in (stats.get("skipped") or {}).items():
            kept[reason] = kept.get(reason, 0) + n
        replaced = self.stream.pool.apply(round_no, examples)
        res = RoundResult(round_no, step, int(stats.get("prompts", 0)), int(stats.get("written", 0)), replaced,
                          int(stats.get("tokens_generated", 0)), kept, reused, time.time() - t0)
        log.info("step %d regenerate round %d: %d prompts, %d answered, %d tokens generated, %d examples replaced%s "
                 "(%.1f s); %d rounds, %d examples replaced in all", step, round_no, res.prompts, res.answered,
                 res.tokens_generated, replaced, f", original kept for {kept}" if kept else "", res.wall_s,
                 self.rounds_done, self.examples_replaced)
        return res

    # ---- answering -----------------------------------------------------------------------------
    def _extra_body(self) -> dict:
        """The openai back end's extra request fields: the template's variables, as the server takes them."""
        kwargs = self.cfg.data.chat_template_kwargs
        return {"chat_template_kwargs": dict(kwargs)} if kwargs else {}

    def _backend(self, round_no: int, redactor: Redactor):
        r = self.cfg.regenerate
        if r.backend == "openai":
            from specjax.regen.client import ChatClient, OpenAIBackend

            client = ChatClient(r.endpoint, r.model, api_key_env=r.api_key_env, timeout_s=r.timeout_s,
                                max_retries=r.max_retries, redactor=redactor, extra_body=self._extra_body())
            return OpenAIBackend(client, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                 keep_reasoning=r.keep_reasoning, concurrency=r.concurrency)
        from specjax.regen.jax_backend import JaxBackend, eos_token_ids

        # the round joins the seed: a prompt met again in a later round is sampled anew (temperature > 0)
        return JaxBackend(self.target, self.tokenizer, chat_template=self.template,
                          eos_ids=eos_token_ids(self.tokenizer, self.cfg.target.path),
                          max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                          max_prompt_tokens=r.max_prompt_tokens, batch_size=r.batch_size, seed=r.seed + round_no,
                          keep_reasoning=r.keep_reasoning, long_prompts=r.long_prompts,
                          segment_steps=r.segment_steps, template_limits=TemplateLimits.of(self.cfg.data))

    def _generate(self, round_no: int, path: str) -> dict:
        r = self.cfg.regenerate
        items = self.slice(round_no)
        redactor = Redactor(os.environ.get(r.api_key_env) if r.backend == "openai" else None)
        regen_log = logging.getLogger("specjax.regen")
        regen_log.addFilter(redactor)
        try:
            engine = self._backend(round_no, redactor)
            if hasattr(engine, "run_flows"):
                flows = [ConversationFlow(it, r.turns == "all") for it in items]
                engine.run_flows(((i, f, (0,)) for i, f in enumerate(flows)), lambda key, flow: None)
                convs = [f.conversation for f in flows]
            else:
                convs = answer_every_turn(engine.answer, items, r.turns == "all")
        finally:
            regen_log.removeFilter(redactor)
        rows, skipped, tokens = [], {}, 0
        for it, conv in zip(items, convs):
            tokens += conv.new_tokens
            if conv.messages is None:
                reason = conv.skip_reason or "no answer"
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            rows.append((conv.messages, it.source_index))
        stats = {"round": round_no, "prompts": len(items), "written": len(rows), "skipped": skipped,
                 "tokens_generated": tokens}
        write_shard(self.dir, round_no, rows, stats)
        return stats

    # ---- reading back ----------------------------------------------------------------------------
    def _examples(self, round_no: int, path: str) -> tuple[dict[int, Example], dict]:
        return read_round_examples(self.cfg, self.tokenizer, self.template, path, self.n_train)

    def load_round(self, round_no: int) -> dict[int, Example]:
        return round_loader(self.cfg, self.tokenizer, self.dir, self.n_train, self.template)(round_no)


def read_round_examples(cfg, tokenizer, template, path: str, n_train: int) -> tuple[dict[int, Example], dict]:
    """A round shard's conversations templated, masked and truncated as the training data is
    (tokenize_conversation with the data.* settings): ({training index: example}, {reason: n} of the
    conversations that would be a skipped row and so keep their original example)."""
    import pyarrow.parquet as pq

    d = cfg.data
    table = pq.read_table(path).to_pydict()
    examples, kept = {}, {}
    for j, (messages, index) in enumerate(zip(table["messages"], table["source_index"])):
        if not 0 <= index < n_train:
            raise ValueError(f"{path} row {j + 1} names training example {index}, but the run has "
                             f"{n_train}: it was written for other data. Fix: delete {os.path.dirname(path)}, or "
                             "use a new run.output_dir")
        try:
            ex = tokenize_conversation(
                tokenizer, messages, d.seq_length, truncate=d.truncate, chat_template=template,
                mask_reasoning_content=d.mask_reasoning_content, mask_generation_prompt=d.mask_generation_prompt)
        except SkipRow as e:
            kept[e.reason] = kept.get(e.reason, 0) + 1
            continue
        except ChatTemplateUnusable as e:
            raise type(e)(f"{e} (first met rendering {path}:{j + 1})") from e
        examples[int(index)] = replace(ex, source=path, row=j + 1)
    return examples, kept


def round_loader(cfg, tokenizer, rounds_dir: str, n_train: int, template=None) -> Callable[[int], dict]:
    """`load_round(n) -> {training index: example}`: round n read back from its shard in `rounds_dir`
    (a RegenStream's restore); a missing shard is a RegenShardMissing naming the fix."""
    def load(round_no: int) -> dict[int, Example]:
        nonlocal template
        path = os.path.join(rounds_dir, shard_name(round_no))
        if not os.path.isfile(path):
            raise RegenShardMissing(
                f"the checkpoint's data position includes regeneration round {round_no}, whose answers {path} are "
                f"gone. Fix: restore {path} (or the whole {rounds_dir}), or start fresh with "
                "checkpoint.restore_from=none")
        if template is None:
            d = cfg.data
            template = resolve_chat_template(tokenizer, d.chat_template, TemplateLimits.of(d), d.chat_template_kwargs)
        return read_round_examples(cfg, tokenizer, template, path, n_train)[0]
    return load


def make_regen_rounds(cfg, data, *, target, tokenizer, out_dir: str, data_sha256: str, files, val_files=()) \
        -> Optional[RegenRounds]:
    """The run's RegenRounds (None when regenerate.every_steps is 0), bound to its stream. With
    every_steps 0 the stream still reads back the rounds a checkpoint applied (regeneration turned off
    on resume keeps their examples)."""
    if not cfg.regenerate.every_steps:
        if isinstance(data.iterator, RegenStream):
            data.iterator.load_round = round_loader(cfg, tokenizer, os.path.join(out_dir, REGEN_ROUNDS_DIR),
                                                    len(data.prepared.train))
        return None
    prompts, left_out = training_prompts(cfg, data.prepared, files, val_files)
    log.info("regenerate.every_steps=%d: %d of %d training prompts in rounds of %d%s", cfg.regenerate.every_steps,
             len(prompts), len(data.prepared.train), cfg.regenerate.slice_size,
             f" (left out: {left_out})" if left_out else "")
    return RegenRounds(cfg, data.iterator, prompts, n_train=len(data.prepared.train), target=target,
                       tokenizer=tokenizer, out_dir=out_dir, data_sha256=data_sha256)



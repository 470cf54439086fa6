"""A run, built once from its config: `build_run(cfg) -> Run`, everything the training loop needs.

Stages, each run once, in this order: the run-folder lock (specjax.run_lock: one run per
run.output_dir, held until the Run is closed) -> preflight (jinja2, the tokenizer when it is on
disk, its chat template) -> the target folder (the demo build, the GGUF conversion) -> the draft
against the target's config.json (taps, draft vocab size, draft config) -> the
regeneration stage (regenerate.enabled) -> the target, its weights on the mesh -> the tokenizer
(preflight's, or loaded now when the target build wrote it) -> the data (training examples, eval
batches, the data iterator) -> the draft vocabulary -> the regeneration rounds (regenerate.every_steps:
the training prompts, <run>/regen_rounds; specjax.train.regen_rounds) -> the run set-up (specjax.train.setup: draft
config, objective, optimizer, step functions) and the initial state -> restore (the latest
checkpoint and data position) -> run_meta.json and decode_eval.

The config is completed where its missing values become known and nowhere else: the regeneration
stage fills data.train_files before the data stage reads them, and train.epochs becomes
train.steps right after the data stage, before anything reads train.steps. `Run.cfg` is that final
config; every stage after the data stage is built from it.

Every checkpoint records the run's identity (`run_identity`: config, a hash of the training
examples' token ids, a hash of the draft vocabulary) and its step. A resume compares them with this
run's (`resume_differences`): differences of settings or data are refused unless
checkpoint.allow_config_change; a checkpoint of another draft vocabulary, or one whose folder name
is not its step, is always refused, with every difference listed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax import checkpoint as ckpt
from specjax import run_lock
from specjax.config import Config, config_to_dict, default_config_dict
from specjax.data import make_eval_batches, make_train_iterator, prepare_examples
from specjax.data.chat import TemplateLimits, check_chat_template
from specjax.data.datasets import resolve_data_paths
from specjax.data.pipeline import Prepared, batches_per_epoch, write_skip_report
from specjax.data.sources import RowLimits
from specjax.run_files import VOCAB_FILE, checkpoints_dir, run_meta_kept_path, run_meta_path, vocab_path
from specjax.train.cache_source import (cache_fields, cache_origin, cache_val_batches, check_cache_settings,
                                        check_cache_vocab, describe, examples_from_cache, foreign_cache_fields,
                                        make_cache_iterator, open_checked_cache)
from specjax.train.decode_eval import make_decode_eval
from specjax.train.regen_rounds import (RegenPool, RegenStream, check_regen_settings, check_regen_steps,
                                        make_regen_rounds)
from specjax.train.setup import (
    RunSetup, build_run_setup, build_tokenizer, build_vocab, check_batch_fits, check_draft_fits_target, check_writable,
    load_prepared_target, make_mesh, preflight, prepare_target_folder, resolve_aux_ids, resolve_path,
)
from specjax.train.signals import StopSignal
from specjax.train.step import init_state

log = logging.getLogger("specjax")


@dataclass(frozen=True)
class RunData:
    """The data stage's output: the prepared examples (train, val, skip counts), the validation
    batches and the training iterator (one global iterator, identical on every process: each
    process feeds its rows of the global batch to its devices)."""
    prepared: Any  # specjax.data.pipeline.Prepared
    val_batches: list
    iterator: Any

    @property
    def train(self):
        return self.prepared.train


@dataclass(frozen=True)
class Run:
    """What `build_run` made; the loop reads it and changes nothing in it. `state` is the state
    training starts from (restored or fresh); the first step donates its buffers. A Run holds the
    run-folder lock until `close()` (or the end of its `with` block)."""
    cfg: Config  # the final config (see the module doc)
    out_dir: str
    t_start: float  # when the set-up began: RunResult.wall_time_s counts from here
    mesh: Any
    target: Any
    tokenizer: Any
    data: RunData
    vocab: Any
    identity: dict  # recorded in every checkpoint (run_identity)
    setup: RunSetup
    target_params: Any  # on the step's shardings
    vocab_arrays: dict  # draft_ids / t2d / d2t on the step's shardings
    state: Any
    start_step: int
    mngr: Any  # the run's checkpoint manager (<out_dir>/checkpoints)
    decode_eval: Any  # JaxDecodeEval / VllmDecodeEval (specjax.train.decode_eval), or None when off
    held: contextlib.ExitStack  # the run-folder lock
    resume_meta: dict = field(default_factory=dict)  # the restored checkpoint's meta ({} when starting fresh)
    regen: Any = None  # specjax.train.regen_rounds.RegenRounds when regenerate.every_steps, else None

    def close(self) -> None:
        self.held.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_run(cfg: Config, stop: Optional[StopSignal] = None) -> Run:
    """Every stage of a run's set-up, once, in the order of the module doc. `stop`: the run's
    StopSignal, paused during the regeneration stage (a signal there ends the process, and a rerun
    resumes the regeneration). The lock is released if a stage fails."""
    t_start = time.time()
    out_dir = os.path.abspath(cfg.run.output_dir)
    with contextlib.ExitStack() as held:
        held.enter_context(run_lock.holding(cfg.run.output_dir))  # before anything writes into the folder
        check_writable(out_dir)
        tokenizer = preflight(cfg)  # before anything expensive: jinja2, the tokenizer, its template
        prepare_target_folder(cfg)
        check_draft_fits_target(cfg)  # the taps, the draft vocab, the draft config: before any data pass
        check_cache_settings(cfg)
        check_regen_settings(cfg, jax.process_count())
        with stop.paused() if stop is not None else contextlib.nullcontext():
            cfg = run_regenerate_stage(cfg)
        mesh = make_mesh(cfg)
        target = load_prepared_target(cfg, mesh)
        tokenizer = checked_tokenizer(cfg, tokenizer, target)
        data = _prepare_data(cfg, tokenizer, out_dir, target)
        cfg = resolve_steps(cfg, data.train)
        check_regen_steps(cfg)

        vocab = build_vocab(cfg, data.train, target.config.vocab_size, out_dir)
        if cfg.target.source == "cache":
            check_cache_vocab(cfg, vocab)
        identity = run_identity(cfg, data.train, vocab)
        # before the restore, which reads the applied rounds back through it
        regen = make_regen_rounds(cfg, data, target=target, tokenizer=tokenizer, out_dir=out_dir,
                                  data_sha256=identity["data_sha256"],
                                  files=tuple(resolve_path(p) for p in cfg.data.train_files),
                                  val_files=tuple(resolve_path(p) for p in cfg.data.val_files))
        check_batch_fits(cfg, mesh)
        setup = build_run_setup(cfg, target, mesh)
        draft_params = setup.init_draft_params(vocab)
        target_params = jax.device_put(target.params, setup.fns.target_shardings)
        vocab_arrays = jax.device_put(
            {"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
             "d2t": jnp.asarray(vocab.d2t, jnp.int32)}, setup.fns.vocab_shardings)
        state = jax.jit(lambda p: init_state(p, setup.optimizer),
                        out_shardings=setup.fns.state_shardings)(draft_params)
        del draft_params

        mngr = ckpt.manager(checkpoints_dir(out_dir), keep=cfg.checkpoint.keep)
        resume = _Resume(cfg, out_dir, identity, mngr, data.iterator)
        state, start_step = resume.restore(state)
        _write_run_meta(cfg, setup, target, out_dir, resumed_at=start_step)
        decode_eval = _make_decode_eval(cfg, target, tokenizer, setup, vocab, mesh, out_dir)
        return Run(cfg=cfg, out_dir=out_dir, t_start=t_start, mesh=mesh, target=target, tokenizer=tokenizer,
                   data=data, vocab=vocab, identity=identity, setup=setup, target_params=target_params,
                   vocab_arrays=vocab_arrays, state=state, start_step=start_step, mngr=mngr,
                   decode_eval=decode_eval, held=held.pop_all(), resume_meta=resume.meta, regen=regen)


# ---------------------------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------------------------
def run_regenerate_stage(cfg: Config) -> Config:
    """When `regenerate.enabled`: run the regeneration stage (resumable: a rerun continues it)
    and return the config training should use -- `data.train_files` defaults to its output."""
    if not cfg.regenerate.enabled:
        return cfg
    from specjax.regenerate import output_dir, run_from_config

    if jax.process_count() > 1:
        raise ValueError(
            "regenerate.enabled runs in one process; with several processes run "
            "`python -m specjax.regenerate --config X` once first, then train with regenerate.enabled=false"
        )
    # checked before regenerating: a run that would regenerate data it then does not train on is refused
    # at once, not after the regeneration (all of ShareGPT is ~11 minutes on an H200)
    planned = output_dir(cfg)
    if cfg.data.train_files and os.path.abspath(planned) not in {os.path.abspath(p) for p in cfg.data.train_files}:
        raise ValueError(
            f"regenerate.enabled would write {planned}, which data.train_files {list(cfg.data.train_files)} does "
            "not list, so training would not use it: add it to data.train_files, or set regenerate.enabled=false "
            "to train on the listed files only")
    out = run_from_config(cfg)
    if not cfg.data.train_files:
        log.info("regenerated data in %s; training on it (data.train_files was empty)", out)
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_files=(out,)))
    log.info("regenerated data in %s (listed in data.train_files)", out)
    return cfg


def checked_tokenizer(cfg: Config, tokenizer, target):
    """Preflight's tokenizer, or, when the target build wrote it (demo, GGUF), the one loaded and
    checked now, before the data pass; either way it must fit the target's vocabulary."""
    if tokenizer is None:
        tokenizer = build_tokenizer(cfg)
        check_chat_template(tokenizer, cfg.data.chat_template, TemplateLimits.of(cfg.data),
                            cfg.data.chat_template_kwargs)
    if len(tokenizer) > target.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the target's vocab_size is "
            f"{target.config.vocab_size}; use the target's own tokenizer (data.tokenizer)."
        )
    return tokenizer


def _prepare_data(cfg: Config, tokenizer, out_dir: str, target=None) -> RunData:
    """data.*: the training files -> examples (every skipped row, file:line and reason, in
    <out_dir>/skipped_rows.jsonl), the validation batches and the training iterator; with
    target.source=cache the batches are the state cache's rows (checked against these examples; a cache
    imported from a foreign dump is checked on cache_source.FOREIGN_CHECKED only, and its rows are the
    examples: data.train_files is not read)."""
    d = cfg.data
    if d.train_file_weights and len(d.train_file_weights) != len(d.train_files):
        raise ValueError(f"data.train_file_weights has {len(d.train_file_weights)} weights for "
                         f"{len(d.train_files)} data.train_files entries; give one weight per entry (or none)")
    if any(w <= 0 for w in d.train_file_weights):
        raise ValueError(f"data.train_file_weights {list(d.train_file_weights)}: every weight must be > 0 "
                         "(leave an entry out of data.train_files to drop it)")
    origin = cache_origin(cfg) if cfg.target.source == "cache" else None
    if origin is not None:  # an imported dump: its examples are the cache's rows, not data.train_files'
        aux_ids = resolve_aux_ids(cfg, target)
        cache = open_checked_cache(cfg, foreign_cache_fields(cfg, aux_ids, origin))
        prepared = examples_from_cache(cache)
    else:
        prepared = prepare_training_examples(cfg, tokenizer, out_dir)
    if cfg.target.source == "cache":
        if origin is None:
            cache = open_checked_cache(cfg, cache_fields(cfg, prepared, tokenizer, resolve_aux_ids(cfg, target)))
        log.info("data: %s", describe(cache))
        state_dtype = np.float32 if cfg.target.dtype == "float32" else ml_dtypes.bfloat16
        return RunData(prepared=prepared,
                       val_batches=cache_val_batches(cache, d.batch_size, cfg.train.eval_batches, state_dtype),
                       iterator=make_cache_iterator(cache, d.batch_size, d.shuffle_seed, state_dtype,
                                                    jax.process_index(), jax.process_count()))
    # a pool with regeneration off too: a checkpoint of the run's regenerating part holds the rounds it
    # applied, which a resume with regenerate.every_steps=0 keeps (regen_rounds.py, "Turned off on resume")
    pool = RegenPool()
    iterator = make_train_iterator(prepared.train, d.seq_length, d.batch_size, d.shuffle_seed, pool=pool,
                                   **_file_mixture(d, prepared.train))
    return RunData(
        prepared=prepared,
        val_batches=make_eval_batches(prepared.val, d.seq_length, d.batch_size)[: cfg.train.eval_batches],
        iterator=RegenStream(iterator, pool, plain_when_empty=not cfg.regenerate.every_steps))


def _file_mixture(d, examples) -> dict:
    """make_train_iterator's `groups` (each example's data.train_files entry) and `weights`, when
    data.train_file_weights is set; {} otherwise."""
    if not d.train_file_weights:
        return {}
    entry_of = {}
    for g, entry in enumerate(d.train_files):
        for f in resolve_data_paths(resolve_path(entry)):
            entry_of.setdefault(str(f), g)
    groups = [entry_of[ex.source] for ex in examples]
    counts = Counter(groups)
    log.info("data: train_file_weights %s over %s examples per entry", list(d.train_file_weights),
             [counts.get(g, 0) for g in range(len(d.train_files))])
    return {"groups": groups, "weights": tuple(d.train_file_weights)}


def prepare_training_examples(cfg: Config, tokenizer, out_dir: str):
    """data.*: the training files -> prepared examples (train / val split, every skipped row,
    file:line and reason, in <out_dir>/skipped_rows.jsonl), or a ValueError when none is usable."""
    d = cfg.data
    files = tuple(resolve_path(p) for p in d.train_files)
    if not files:
        raise ValueError("data.train_files is empty: give one or more JSONL/JSON/parquet chat files.")
    t_prep = time.perf_counter()

    def prepare(paths, val_fraction, max_rows, report_dir):
        return prepare_examples(
            paths, tokenizer, d.seq_length, val_fraction, d.shuffle_seed,
            max_rows=max_rows, truncate=d.truncate, chat_template=d.chat_template,
            mask_reasoning_content=d.mask_reasoning_content, mask_generation_prompt=d.mask_generation_prompt,
            skip_report_dir=report_dir, workers=d.prepare_processes(),
            row_limits=RowLimits.of(d), template_limits=TemplateLimits.of(d), template_variables=d.chat_template_kwargs,
        )

    if not d.val_files:
        prepared = prepare(files, d.val_fraction, d.max_rows, out_dir)
    else:  # validation from its own files: the training files are not split
        log.info("data: validation from data.val_files %s (data.val_fraction=%g is not used)", list(d.val_files),
                 d.val_fraction)
        train_part = prepare(files, 0.0, d.max_rows, None)
        val_part = prepare(tuple(resolve_path(p) for p in d.val_files), 0.0, None, None)
        prepared = Prepared(train=train_part.train, val=val_part.train,
                            skipped=dict(Counter(train_part.skipped) + Counter(val_part.skipped)),
                            n_rows=train_part.n_rows + val_part.n_rows, skips=train_part.skips + val_part.skips)
        write_skip_report(prepared, out_dir)
    n_skipped = sum(prepared.skipped.values())
    log.info("data: %d rows -> %d train / %d val examples; skipped %d %s (%.1f s)", prepared.n_rows,
             len(prepared.train), len(prepared.val), n_skipped, dict(prepared.skipped),
             time.perf_counter() - t_prep)
    if not prepared.train:
        raise ValueError(f"no usable training rows in {files} (skipped: {dict(prepared.skipped)}).")
    return prepared


def resolve_steps(cfg: Config, train_examples) -> Config:
    """train.epochs, when set, as train.steps: whole packed batches of `epochs` passes over the
    training examples. Otherwise `cfg` itself."""
    if cfg.train.epochs is None:
        return cfg
    per_epoch = batches_per_epoch(train_examples, cfg.data.seq_length, cfg.data.batch_size)
    steps = max(1, math.ceil(cfg.train.epochs * per_epoch))
    log.info("train.epochs=%g: %d packed batches of %d x %d per pass -> train.steps=%d (was %d)",
             cfg.train.epochs, per_epoch, cfg.data.batch_size, cfg.data.seq_length, steps, cfg.train.steps)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))


def _make_decode_eval(cfg: Config, target, tokenizer, setup: RunSetup, vocab, mesh, out_dir: str):
    if not (cfg.decode_eval.every_steps or cfg.decode_eval.at_end):
        return None
    measure = make_decode_eval(cfg, target, tokenizer, setup.draft_config, vocab, mesh, out_dir)
    log.info("decode_eval (%s): %d prompts from %s, every %s steps%s", cfg.decode_eval.backend,
             len(measure.prompts), list(cfg.decode_eval.prompts),
             cfg.decode_eval.every_steps or "-", " and at the end" if cfg.decode_eval.at_end else "")
    return measure


def _write_run_meta(cfg: Config, setup: RunSetup, target, out_dir: str, resumed_at: int = 0) -> None:
    draft_meta = setup.family.run_meta(setup.draft_config)  # draft_config, and draft_family when not EAGLE-3
    meta = {
        "config": config_to_dict(cfg),
        "draft_config": draft_meta.pop("draft_config"),
        "target_path": os.path.abspath(cfg.target.path),
        "target_config": target.hf_config,
        "vocab_file": VOCAB_FILE,
        **draft_meta,
    }
    if resumed_at:
        meta["resumed_at_step"] = resumed_at
    if jax.process_index() == 0:
        with open(run_meta_path(out_dir), "w") as f:
            json.dump(meta, f, indent=1)


# ---------------------------------------------------------------------------------------------
# the run's identity and what may differ on resume
# ---------------------------------------------------------------------------------------------
# Settings that may change between a run and its resumption without changing what is trained: how
# long this invocation runs and reports, where it checkpoints and exports, how it is parallelised
# and which kernels compute it. Any other difference is refused unless checkpoint.allow_config_change.
_RESUME_MAY_CHANGE = ("run.output_dir", "run.name", "train.stop_at_step", "train.progress", "train.log_every",
                      "train.eval_every", "train.eval_batches", "train.max_consecutive_skips", "checkpoint.",
                      "export.", "parallelism.", "kernels.", "decode_eval.", "regenerate.")
# ... except these, which decide what a run trains on after its first round (and the form of its data position)
_RESUME_MUST_MATCH = ("regenerate.every_steps", "regenerate.slice_size")


def config_differences(saved: dict, now: dict) -> list[str]:
    """`key: saved -> now` for every setting that differs and matters to a resumed run. A key the saved
    config lacks (written by an older specjax) counts as its default."""
    defaults = default_config_dict()
    out = []
    for section in sorted(set(saved) | set(now)):
        a, b, d = saved.get(section) or {}, now.get(section) or {}, defaults.get(section) or {}
        for key in sorted(set(a) | set(b)):
            name = f"{section}.{key}"
            if name not in _RESUME_MUST_MATCH and any(
                    name == p or (p.endswith(".") and name.startswith(p)) for p in _RESUME_MAY_CHANGE):
                continue
            old, new = a.get(key, d.get(key)), b.get(key, d.get(key))
            if old != new:
                out.append(f"{name}: {old!r} -> {new!r}")
    return out


def run_identity(cfg: Config, train_examples, vocab) -> dict:
    """What a checkpoint of this run records about the run, to be compared on resume
    (`resume_differences`): the config, a hash of the training examples' token ids and one of the
    draft vocabulary."""
    config = config_to_dict(cfg)
    return {"format": 1, "config": config, "config_sha256": ckpt.config_sha256(config),
            "data_sha256": ckpt.examples_sha256(train_examples), "train_examples": len(train_examples),
            "draft_vocab_sha256": ckpt.vocab_sha256(vocab)}


def _short(digest) -> str:
    return f"{digest[:12]}…" if isinstance(digest, str) else repr(digest)


def resume_differences(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """The differences between the identity a checkpoint recorded (`saved`) and this run's (`now`), as
    (what checkpoint.allow_config_change may accept, what nothing accepts). Settings and data may
    change on purpose (any data.* change alters the token ids, and the override exists for such
    changes); the draft vocabulary never changes within a run folder (draft_vocab.npz is reused on
    every resume), and the draft's lm_head rows are in its order, so a different one means the
    checkpoint's params belong to another run."""
    config = saved.get("config")
    allowed = [f"config {d}" for d in config_differences(config if isinstance(config, dict) else {}, now["config"])]
    if saved.get("data_sha256") != now["data_sha256"]:
        allowed.append(f"data sha256 {_short(saved.get('data_sha256'))} -> {_short(now['data_sha256'])} (the "
                       f"training examples' token ids: {saved.get('train_examples')} -> {now['train_examples']} "
                       f"examples)")
    never = []
    if saved.get("draft_vocab_sha256") != now["draft_vocab_sha256"]:
        never.append(f"draft vocabulary sha256 {_short(saved.get('draft_vocab_sha256'))} -> "
                     f"{_short(now['draft_vocab_sha256'])} ({VOCAB_FILE})")
    return allowed, never


# ---------------------------------------------------------------------------------------------
# restore: the latest (or the named) checkpoint, if it is of this run
# ---------------------------------------------------------------------------------------------
@dataclass
class _Resume:
    """The restore stage of one run: its final config, folder, identity, checkpoint manager and
    data iterator (whose position a checkpoint restores)."""
    cfg: Config
    out_dir: str
    identity: dict
    mngr: Any
    data_iter: Any
    meta: dict = field(default_factory=dict)  # the restored checkpoint's meta, once restore() found one

    def restore(self, state):
        """latest: the newest checkpoint that verifies (damaged ones are moved aside, see
        specjax.checkpoint); an explicit <run>/checkpoints/<step>: that one, or an error naming its
        damage. Either way the checkpoint must be of this run (`_check_resume`)."""
        restore_from = self.cfg.checkpoint.restore_from
        if restore_from == "none" or (not self.mngr.all_steps() and restore_from == "latest"):
            return state, 0
        abstract = ckpt.abstract_like(state)
        if restore_from == "latest":  # before the data position is restored into another dataset
            try:  # shapes first: a draft of other shapes can never resume, whatever the settings allow
                ckpt.check_compatible(self.mngr, self.mngr.latest_step(), abstract)
            except ckpt.CheckpointMismatch:
                raise
            except Exception:  # noqa: BLE001 - unreadable metadata: restore_verified handles the damage
                pass
            rdir = str(self.mngr.directory)
            restored, meta, _ = ckpt.restore_verified(
                self.mngr, abstract, self.data_iter, check_meta=lambda step, meta: self._check_resume(rdir, step, meta))
            if restored is None:  # every step folder was damaged and moved aside: start fresh
                return state, 0
            self.meta = meta if isinstance(meta, dict) else {}
        else:
            restored, rdir = self._restore_explicit(restore_from, abstract)
        start_step = int(restored["step"])
        log.info("resumed from %s at step %d", rdir, start_step)
        return restored, start_step

    def _restore_explicit(self, restore_from: str, abstract):
        """checkpoint.restore_from=<run>/checkpoints/<step>: that checkpoint or an error; one whose
        checksum list is missing or unusable is used with a warning (it was asked for by name)."""
        rdir, step = os.path.split(os.path.abspath(restore_from))
        if not step.isdigit() or not os.path.isdir(restore_from):
            raise FileNotFoundError(
                f"checkpoint.restore_from={restore_from!r} is not a saved checkpoint; give a "
                f"<run>/checkpoints/<step> folder, 'latest' (default) or 'none'.")
        step = int(step)
        files = ckpt.check_files(rdir, step)
        if files.damage is not None:
            raise ckpt.CheckpointDamaged(
                f"checkpoint.restore_from={restore_from!r} is damaged: {files.damage}. Give an older "
                f"<run>/checkpoints/<step>, or 'latest' to take the newest one that verifies.")
        if files.unverified is not None:
            log.warning("checkpoint.restore_from=%s could not be verified: %s. It is used as asked, unverified: a "
                        "changed byte in it would go unnoticed.", restore_from, files.unverified)
        rmngr = ckpt.manager(rdir, read_only=True)
        ckpt.check_compatible(rmngr, step, abstract)
        self.meta = ckpt.read_meta(rmngr, step)
        self._check_resume(rdir, step, self.meta)
        restored, _ = ckpt.restore(rmngr, abstract, self.data_iter, step=step)
        ckpt.check_restored_step(rdir, step, restored)
        if not ckpt.all_finite({"params": restored["params"], "opt_state": restored["opt_state"]}):
            raise ckpt.CheckpointDamaged(
                f"checkpoint.restore_from={restore_from!r} holds NaN/Inf params or optimizer state; give an "
                f"older <run>/checkpoints/<step>, or 'latest' to take the newest one that verifies.")
        return restored, rdir

    def _check_resume(self, ckpt_dir: str, step: int, meta: dict) -> None:
        """A resumed run trains what the checkpoint's run trained: the same data, model, objective,
        schedule and draft vocabulary, from the step its folder names. The checkpoint's recorded
        identity is compared with this run's (`resume_differences`); a checkpoint from before
        identities is compared by its run folder's run_meta.json, with a warning that its data and
        vocabulary cannot be checked. Settings and data differences are refused unless
        checkpoint.allow_config_change; another draft vocabulary or step is always refused."""
        where = os.path.join(ckpt_dir, str(step))
        explicit = self.cfg.checkpoint.restore_from != "latest"
        saved, saved_step = meta.get(ckpt.IDENTITY), meta.get("step")
        other_step = ([f"step: folder {step} holds step {saved_step}"]
                      if isinstance(saved_step, int) and saved_step != step else [])
        other_vocab = []
        if isinstance(saved, dict):
            allowed, other_vocab = resume_differences(saved, self.identity)
        else:
            run_meta = run_meta_path(os.path.dirname(os.path.abspath(ckpt_dir)))
            log.warning("checkpoint %s records no run identity (written by an older specjax): its data and draft "
                        "vocabulary could not be checked against this run's; only the settings in %s are compared.",
                        where, run_meta)
            allowed = [f"config {d}" for d in self._run_meta_differences(run_meta)]
        if other_vocab or other_step:
            raise ckpt.CheckpointFromAnotherRun(self._foreign_checkpoint_message(
                where, step, allowed + other_vocab + other_step, bool(other_vocab), bool(other_step)))
        if not allowed:
            return
        if not self.cfg.checkpoint.allow_config_change:
            head = (f"starting {self.out_dir} from checkpoint {where} (checkpoint.restore_from), which was trained "
                    f"with a different configuration or data:" if explicit else
                    f"resuming {self.out_dir} at step {step} with a different configuration or data than it was "
                    f"trained with:")
            fix = ("Give a checkpoint of a run with these settings, set checkpoint.restore_from=none to start fresh, "
                   "or set checkpoint.allow_config_change=true to start from it with this run's settings and data "
                   "(a warm start)." if explicit else
                   "Use a new run.output_dir, set checkpoint.restore_from=none to start fresh, or set "
                   "checkpoint.allow_config_change=true to resume with the new settings and data.")
            raise ValueError(f"{head}\n  " + "\n  ".join(allowed) + f"\n{fix}")
        path = run_meta_path(self.out_dir)
        kept = run_meta_kept_path(self.out_dir, step)
        moved = os.path.exists(path)
        if jax.process_index() == 0 and moved:
            os.replace(path, kept)
        log.warning("%s at step %d with a changed configuration or data (checkpoint.allow_config_change): %s%s",
                    f"starting from {where}" if explicit else "resuming", step, "; ".join(allowed),
                    f"; the previous run_meta.json is kept as {kept}" if moved else "")

    def _run_meta_differences(self, path: str) -> list[str]:
        """config_differences between the run_meta.json at `path` (none: nothing to compare) and now."""
        if not os.path.exists(path):
            return []
        try:
            with open(path) as f:
                saved = json.load(f).get("config") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{path} cannot be read ({e}); it records the configuration the checkpoints were "
                             f"trained with. Restore it, or set checkpoint.restore_from=none to start fresh.") from e
        return config_differences(saved, config_to_dict(self.cfg))

    def _foreign_checkpoint_message(self, where: str, step: int, differences: list[str], other_vocab: bool,
                                    other_step: bool) -> str:
        ckpt_dir, run_dir = os.path.dirname(where), os.path.dirname(os.path.dirname(where))
        why = " ".join(
            ([f"Its draft's lm_head rows are in the order of another draft vocabulary, so no setting can resume it "
              f"with this run's {VOCAB_FILE}."] if other_vocab else [])
            + (["A checkpoint folder is named after the step it saved; this one was copied in or renamed."]
               if other_step else []))
        if self.cfg.checkpoint.restore_from != "latest":
            fix = (f"To continue that run, start in a new run.output_dir holding a copy of "
                   f"{vocab_path(run_dir)} (add checkpoint.allow_config_change=true if its settings or "
                   "data differ); to start from its weights only, set draft.init_from to its export."
                   if other_vocab else
                   "Give the checkpoint folder whose name is its step.")
        else:
            fix = (f"Move {where} out of {ckpt_dir} (the run then resumes from its own older checkpoints), use a new "
                   "run.output_dir, or set checkpoint.restore_from=none to start fresh"
                   + ("; to start from another run's weights, set draft.init_from to its export." if other_vocab
                      else "."))
        return (f"checkpoint {where} does not belong to this run ({self.out_dir}) as step {step}:\n  "
                + "\n  ".join(differences) + f"\n{why} {fix}")

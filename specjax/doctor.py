"""Check a setup before a long run.

    python -m specjax.doctor --config X [overrides ...] [--draft DIR] [--rows N]
    python -m specjax.doctor --target DIR [--data FILE ...] [--draft DIR]

Checks the environment (versions, devices, mesh fit), the target folder, the tokenizer and its chat
template, a sample of the data (usable rows, tokens, loss-mask density) and, with --draft, the
export contract of a draft folder. `--target` checks a target folder (e.g. one `specjax.convert`
wrote) with the default config, and the data files given with `--data` if any. Prints one line per
check; exits 1 if any check failed: a setup the doctor passes is one `specjax.launch` accepts.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from dataclasses import dataclass, field


@dataclass
class Report:
    lines: list = field(default_factory=list)
    failed: int = 0

    def ok(self, what, detail=""):
        self.lines.append(("OK", what, detail))

    def warn(self, what, detail=""):
        self.lines.append(("WARN", what, detail))

    def fail(self, what, detail=""):
        self.failed += 1
        self.lines.append(("FAIL", what, detail))

    def render(self) -> str:
        return "\n".join(f"[{s:4}] {w}" + (f": {d}" if d else "") for s, w, d in self.lines)


def _check_env(rep: Report, cfg) -> None:
    import jax

    from specjax import mesh as meshlib

    vers = []
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "transformers", "safetensors"):
        try:
            vers.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            rep.fail(f"package {pkg}", "not installed; reinstall specjax (pip install -e .)")
    rep.ok("python " + sys.version.split()[0], ", ".join(vers))
    devs = jax.devices()
    rep.ok("devices", f"{len(devs)} x {devs[0].platform} ({devs[0].device_kind}), {jax.process_count()} process(es)")
    try:
        shape = meshlib.mesh_shape({a: getattr(cfg.parallelism, a) for a in meshlib.MESH_AXES}, len(devs))
        n = shape["data"] * shape["fsdp"] * shape["expert"]
        if cfg.data.batch_size % n:
            rep.fail("mesh fit", f"data.batch_size={cfg.data.batch_size} is not divisible by data*fsdp*expert={n}")
        else:
            rep.ok("mesh fit", str(shape))
    except ValueError as e:
        rep.fail("mesh fit", str(e))


def _check_target(rep: Report, cfg):
    from specjax.targets import SUPPORTED_ARCHITECTURES, get_target_class, validate_aux_layer_ids
    from specjax.targets.loading import read_hf_config

    path = cfg.target.path
    conf_path = os.path.join(path, "config.json")
    if not os.path.exists(conf_path):
        hint = " (it is built on the first run: target.build_demo=true)" if cfg.target.build_demo else ""
        (rep.warn if cfg.target.build_demo else rep.fail)("target folder", f"no config.json in {path!r}{hint}")
        return None
    try:  # the fields checked (types, sanity bounds) before anything is sized from them
        hf = read_hf_config(path)
    except ValueError as e:
        rep.fail("target config", str(e))
        return None
    arch = (hf.get("architectures") or [hf.get("model_type")])[0]
    try:
        cls = get_target_class(hf)
    except ValueError as e:
        rep.fail("target architecture", str(e))
        return None
    rep.ok("target architecture", f"{arch} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    files = os.listdir(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        shards = sorted(set(json.load(open(index))["weight_map"].values()))
        missing = [s for s in shards if s not in files]
        if missing:
            rep.fail("target weights", f"index names missing shard files {missing}; re-download them")
        else:
            rep.ok("target weights", f"{len(shards)} safetensors shards")
    elif "model.safetensors" in files:
        rep.ok("target weights", "model.safetensors")
    else:
        pickles = [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
        rep.fail("target weights", "no safetensors weights" + (f" (found pickle files {pickles}; specjax loads only "
                 "safetensors: convert them, e.g. with transformers' save_pretrained(safe_serialization=True))"
                 if pickles else ""))
    try:
        config = cls.config_from_hf(hf)
        ids = cfg.target.aux_layer_ids or None
        L = config.num_hidden_layers
        from specjax.targets import default_aux_layer_ids

        ids = validate_aux_layer_ids(tuple(ids) if ids else default_aux_layer_ids(L), L)
        rep.ok("aux layer ids", f"{list(ids)} of {L} layers (output-of-layer-k convention)")
    except ValueError as e:
        rep.fail("target config / aux ids", str(e))
        return None
    from specjax.train.setup import check_draft_fits_target

    try:  # the check training runs before its data pass
        check_draft_fits_target(cfg)
        rep.ok("draft", f"draft.type={cfg.draft.type}, {cfg.draft.num_layers} layer(s), draft vocab "
                        f"{cfg.draft.draft_vocab_size} of {config.vocab_size}")
    except ValueError as e:
        rep.fail("draft", str(e))
    return config


def _check_tokenizer_and_data(rep: Report, cfg, target_config, n_rows: int, target_only: bool = False) -> None:
    from specjax.train.setup import build_tokenizer

    tok_path = cfg.data.tokenizer or cfg.target.path
    try:  # the loader training uses, so its refusals are the doctor's
        tok = build_tokenizer(cfg)
    except ValueError as e:
        rep.fail("tokenizer", str(e))
        return
    if target_config is not None and len(tok) > target_config.vocab_size:
        rep.fail("tokenizer", f"{len(tok)} tokens > target vocab_size {target_config.vocab_size}; use the target's tokenizer")
    else:
        rep.ok("tokenizer", f"{len(tok)} tokens from {tok_path}")
    from specjax.data import prepare_examples
    from specjax.data.chat import TemplateLimits, check_chat_template, template_source
    from specjax.data.sources import RowLimits
    from specjax.train.setup import resolve_path

    try:  # jinja2 importable, the template compiles and renders a probe conversation
        check_chat_template(tok, cfg.data.chat_template, TemplateLimits.of(cfg.data), cfg.data.chat_template_kwargs)
        rep.ok("chat template", template_source(tok, cfg.data.chat_template))
    except ValueError as e:
        rep.fail("chat template", str(e))
        return
    files = tuple(resolve_path(p) for p in cfg.data.train_files)
    if not files:
        (rep.warn if target_only else rep.fail)("data", "data.train_files is empty" + (
            " (give data files with --data to check them)" if target_only else ""))
        return
    try:
        prep = prepare_examples(files, tok, cfg.data.seq_length, 0.0, 0, max_rows=n_rows,
                                truncate=cfg.data.truncate, chat_template=cfg.data.chat_template,
                                mask_reasoning_content=cfg.data.mask_reasoning_content,
                                mask_generation_prompt=cfg.data.mask_generation_prompt,
                                row_limits=RowLimits.of(cfg.data), template_limits=TemplateLimits.of(cfg.data),
                                template_variables=cfg.data.chat_template_kwargs)
    except (ValueError, FileNotFoundError) as e:
        rep.fail("data sample", str(e))
        return
    n_tok = sum(len(e) for e in prep.train)
    n_mask = sum(int(e.loss_mask.sum()) for e in prep.train)
    detail = (f"{len(prep.train)}/{prep.n_rows} rows usable, {n_tok} tokens, loss-mask density "
              f"{n_mask / max(n_tok, 1):.2f}, mean length {n_tok / max(len(prep.train), 1):.0f}")
    if prep.skipped:
        rep.warn("data sample", f"{detail}; skipped {prep.skipped}; first: {prep.skip_messages[:3]}")
    else:
        rep.ok("data sample", detail)


def _check_draft(rep: Report, draft_dir: str, target_path: str | None) -> None:
    from specjax_converters.head_formats import errors, validate_folder

    target = target_path if target_path and os.path.exists(os.path.join(target_path, "config.json")) else None
    try:
        findings, info = validate_folder(draft_dir, target=target)
    except (ValueError, FileNotFoundError) as e:
        rep.fail("draft export contract", str(e))
        return
    bad = errors(findings)
    for f in bad:
        rep.fail(f"draft {f.field}", f"{f.problem}. Fix: {f.fix}")
    for f in findings:
        if f.level != "error":
            rep.warn(f"draft {f.field}", f.problem)
    if not bad:
        rep.ok("draft export contract", f"{draft_dir} ({info.get('layout')}, target from {info.get('target_source')})")


def run_doctor(config_path: str | None, overrides=(), draft: str | None = None, rows: int = 200,
               target: str | None = None, data=()) -> Report:
    """The checks for a config file (`config_path` + dotted `overrides`), or, with config_path None,
    for the target folder `target` (and the data files `data`) under the default config."""
    from specjax.config import load_config
    from specjax.train.setup import tokenizer_files

    rep = Report()
    if config_path is None:
        if data:
            overrides = (*overrides, "data.train_files=[" + ",".join(data) + "]")
        cfg = load_config(None, [f"target.path={target}", *overrides])
        rep.ok("config", f"the default config with target.path={target}")
    else:
        cfg = load_config(config_path, overrides)
        rep.ok("config", config_path)
    _check_env(rep, cfg)
    target_config = _check_target(rep, cfg)
    tok_path = cfg.data.tokenizer or cfg.target.path
    will_be_written = not cfg.data.tokenizer and (cfg.target.build_demo or cfg.target.gguf)
    if os.path.isdir(tok_path) and not tokenizer_files(tok_path) and will_be_written:
        rep.warn("tokenizer", f"no tokenizer files in {tok_path!r} yet (the first run writes them: "
                              f"{'target.build_demo' if cfg.target.build_demo else 'target.gguf'})")
    elif not os.path.isdir(tok_path) and not cfg.data.tokenizer:
        if will_be_written:  # else the target folder check has failed already
            rep.warn("tokenizer", f"no tokenizer files in {tok_path!r} yet (the first run builds them)")
    else:
        _check_tokenizer_and_data(rep, cfg, target_config, rows, target_only=config_path is None and not data)
    if draft:
        _check_draft(rep, draft, cfg.target.path)
    return rep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specjax.doctor", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="the run's YAML config")
    p.add_argument("--target", help="instead of --config: a target folder, checked with the default config")
    p.add_argument("--data", action="append", default=[], help="with --target: a data file to sample (repeat for more)")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--draft", help="also validate an exported draft folder")
    p.add_argument("--rows", type=int, default=200, help="data rows to sample")
    a = p.parse_args(argv)
    if (a.config is None) == (a.target is None):
        p.error("give --config (a run's config) or --target (a target folder), not both")
    if a.data and a.config:
        p.error("--data goes with --target; with --config the data is data.train_files")
    from specjax.config import ConfigError

    try:
        rep = run_doctor(a.config, a.overrides, a.draft, a.rows, target=a.target, data=a.data)
    except ConfigError as e:
        print(f"[FAIL] config: {e}")
        return 1
    print(rep.render())
    print(f"doctor: {len(rep.lines) - rep.failed} ok, {rep.failed} failing")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())

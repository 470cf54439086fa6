"""Export a trained draft for vLLM / SGLang, or validate any EAGLE-3 or DFlash head folder.

    python -m specjax.export --checkpoint RUN_DIR --out OUT_DIR [--dtype bf16|fp32] [--step N]
                             [--variant eagle3|eagle3.1]
    python -m specjax.export --validate HEAD_DIR [--target TARGET_DIR]

RUN_DIR is a training run's output_dir (run_meta.json, draft_vocab.npz, checkpoints/<step>/). Only
the draft params are read from the orbax checkpoint; the target model is not needed (its config is
in run_meta.json). The head format is the draft family's (specjax.drafts.family: EAGLE-3 / P-EAGLE
write specjax_converters.eagle3_export's, DFlash dflash_export's; --variant applies to EAGLE-3).
--validate runs every contract rule of the folder's format (specjax_converters.head_formats:
eagle3_validate for EAGLE-3 heads, ours or another trainer's (SpecForge / speculators layout),
dflash_validate for a DFlash head) and exits 1 when it finds an error (2 when the folder cannot be
read).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Mapping, Optional

import numpy as np

from specjax_converters.eagle3_export import normalize_dtype
from specjax_converters.head_formats import errors, validate_folder

from specjax.run_files import (CHECKPOINT_STATE_ITEM, CHECKPOINTS_DIR, RUN_META_FILE, VOCAB_FILE, checkpoint_meta_path,
                               checkpoints_dir, metrics_path, run_meta_path)

log = logging.getLogger("specjax")



def export_from_state(params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, dtype: str = "bfloat16",
                      extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
    """Export draft `params` (host or device arrays) to `out_dir` in the head format of the draft
    config's family; returns the absolute path."""
    from specjax.drafts.families import family_of

    family = family_of(draft_cfg)
    out = family.export(params, draft_cfg, vocab, target_hf_config, out_dir, dtype=dtype,
                        extra_manifest=extra_manifest, variant=variant)
    log.info("exported the %s draft to %s", family.export_name, out)
    return out


class NotARunError(ValueError):
    pass


def _checkpoint_steps(ckpt_dir: str) -> list[int]:
    if not os.path.isdir(ckpt_dir):
        return []
    steps = []
    for name in os.listdir(ckpt_dir):
        # orbax names finished steps by their number; in-progress saves carry a tmp suffix.
        if name.isdigit() and os.path.isdir(os.path.join(ckpt_dir, name, CHECKPOINT_STATE_ITEM)):
            steps.append(int(name))
    return sorted(steps)


def read_run(run_dir: str) -> dict:
    """run_meta.json of a run folder, with a clear error for anything else."""
    run_dir = os.path.abspath(run_dir)
    meta_path = run_meta_path(run_dir)
    if not os.path.isfile(meta_path):
        hint = ""
        for up in (os.path.dirname(run_dir), os.path.dirname(os.path.dirname(run_dir))):
            if os.path.isfile(run_meta_path(up)):
                hint = f" (did you mean {up}?)"
                break
        raise NotARunError(
            f"{run_dir} is not a specjax run folder: no {RUN_META_FILE}{hint}. Pass --checkpoint the run's "
            f"output_dir, the folder holding {RUN_META_FILE}, {VOCAB_FILE} and {CHECKPOINTS_DIR}/."
        )
    with open(meta_path) as f:
        meta = json.load(f)
    missing = [k for k in ("draft_config", "target_config") if k not in meta]
    if missing:
        raise NotARunError(f"{meta_path} lacks {missing}; it was not written by specjax training.")
    return meta


def restore_params(run_dir: str, draft_cfg, step: Optional[int] = None) -> tuple[dict, int]:
    """Only the draft params of checkpoint `step` (default latest), as host numpy arrays."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath  # orbax's path type: its handlers do not accept str

    from specjax.drafts.families import family_of

    ckpt_dir = checkpoints_dir(os.path.abspath(run_dir))
    steps = _checkpoint_steps(ckpt_dir)
    if not steps:
        raise NotARunError(f"no finished checkpoints under {ckpt_dir}; train (or resume) the run first.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"--step {step} is not saved in {ckpt_dir}; available steps: {steps}")
    path = epath.Path(ckpt_dir) / str(step) / CHECKPOINT_STATE_ITEM

    abstract = jax.eval_shape(lambda: family_of(draft_cfg).init_params(draft_cfg, jax.random.key(0)))
    handler = ocp.PyTreeCheckpointHandler()
    saved = handler.metadata(path)
    saved = getattr(saved, "tree", saved)  # orbax returns a TreeMetadata wrapper (a plain tree in some versions)
    if not isinstance(saved, Mapping) or "params" not in saved:
        raise NotARunError(f"{path} holds no 'params' item; it is not a specjax train state.")
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    have = {jax.tree_util.keystr(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(saved["params"])[0]}
    if want != have:
        diff = [f"  {k}: checkpoint {have.get(k)} vs draft_config {want.get(k)}"
                for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
        raise ValueError(f"checkpoint {path} does not match run_meta.json's draft_config:\n" + "\n".join(diff))
    # Host numpy restore: no shardings needed, so any device count can export any run.
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
    restored = handler.restore(path, args=ocp.args.PyTreeRestore(
        item={"params": abstract}, restore_args={"params": restore_args}, partial_restore=True))
    return restored["params"], step


def train_metrics_at(run_dir: str, step: int) -> Optional[dict]:
    """The metrics saved with checkpoint `step` (its meta item), else the last train row of
    metrics.jsonl at or before `step`; None when neither exists."""
    meta_path = checkpoint_meta_path(run_dir, step)
    try:
        with open(meta_path) as f:
            metrics = json.load(f).get("metrics")
        if metrics:
            return metrics
    except (OSError, ValueError, AttributeError):
        pass
    last = None
    try:
        with open(metrics_path(run_dir)) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("split", "train") == "train" and int(row.get("step", -1)) <= step:
                    last = row
    except OSError:
        return None
    return last


# where each kind of number in a manifest comes from (the manifest key -> its source)
METRICS_SOURCES = {
    "metrics": "the last logged training batch at or before `step` (checkpoint meta, else metrics.jsonl split train)",
    "val_metrics": "held-out validation at `val_step`: the mean over the validation batches (train.eval_batches) "
                   "of data.val_fraction's split (metrics.jsonl split val)",
    "decode_eval": "real speculative decoding at `decode_eval_step` (decode_eval.*; tau = 1 + accepted draft "
                   "tokens per verification step; metrics.jsonl split decode)",
}


def eval_manifest(run_dir: str, step: int) -> dict:
    """The manifest keys that judge the head exported at `step`, from the run's metrics.jsonl (the
    latest row per step, every resume included): `val_step` / `val_metrics` (the last validation at or
    before `step`), `decode_eval_step` / `decode_eval` (the last decode_eval at or before `step`) and
    `metrics_sources` (where each comes from). Keys without a row are left out; {} without the file."""
    from specjax.train.metrics import read_history

    hist = read_history(run_dir)
    out = {}
    bookkeeping = ("step", "split", "time")
    val = hist.at_or_before("val", step)
    if val:
        out["val_step"] = val["step"]
        out["val_metrics"] = {k: v for k, v in val.items() if k not in bookkeeping}
    dec = hist.at_or_before("decode", step)
    if dec:
        out["decode_eval_step"] = dec["step"]
        out["decode_eval"] = {k: v for k, v in dec.items() if k not in bookkeeping}
    if out:
        out["metrics_sources"] = {k: v for k, v in METRICS_SOURCES.items()
                                  if k == "metrics" or k in out}
    return out


def export_run(run_dir: str, out_dir: str, dtype: str = "bfloat16", step: Optional[int] = None,
               variant: Optional[str] = None) -> str:
    from specjax.drafts.families import draft_config_from_meta
    from specjax.drafts.vocab import DraftVocab

    run_dir = os.path.abspath(run_dir)
    meta = read_run(run_dir)
    draft_cfg = draft_config_from_meta(meta)
    vocab_path = os.path.join(run_dir, meta.get("vocab_file", VOCAB_FILE))
    if not os.path.isfile(vocab_path):
        raise NotARunError(f"{vocab_path} is missing: the run's draft vocab is needed for d2t/t2d.")
    vocab = DraftVocab.load(vocab_path)
    params, step = restore_params(run_dir, draft_cfg, step)
    extra = {"step": step, "source_run": run_dir, "target_path": meta.get("target_path"),
             "metrics": train_metrics_at(run_dir, step), **eval_manifest(run_dir, step)}
    if "config" in meta:
        extra["config"] = meta["config"]
    return export_from_state(params, draft_cfg, vocab, meta["target_config"], out_dir, dtype=dtype,
                             extra_manifest=extra, variant=variant)


def validate_cli(head_dir: str, target: Optional[str] = None, out=None) -> int:
    """Print every finding for `head_dir`; 0 when it has no errors, 1 when it has."""
    out = out or sys.stdout
    findings, info = validate_folder(head_dir, target=target)
    errs = errors(findings)
    print(f"{os.path.abspath(head_dir)}: {info['layout']} layout; target config: "
          f"{info['target_source'] or 'none'}", file=out)
    for f in sorted(findings, key=lambda f: (f.level != "error", f.rule)):
        print(f"  {f}", file=out)
    print(f"{'INVALID' if errs else 'OK'}: {len(errs)} error(s), {len(findings) - len(errs)} warning(s)", file=out)
    return 1 if errs else 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="the training run's output_dir")
    ap.add_argument("--out", help="folder to write (model.safetensors, config.json)")
    ap.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--variant", default=None, help="eagle3 or eagle3.1 (default: what the draft was trained as)")
    ap.add_argument("--validate", metavar="HEAD_DIR", help="validate a head folder instead of exporting")
    ap.add_argument("--target", help="with --validate: the target model folder (enables the target rules)")
    args = ap.parse_args(argv)
    if args.validate:
        if args.checkpoint or args.out:
            ap.error("--validate takes a head folder only (no --checkpoint/--out)")
        try:
            return validate_cli(args.validate, args.target)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if not args.checkpoint or not args.out:
        ap.error("export needs --checkpoint RUN_DIR and --out OUT_DIR (or use --validate HEAD_DIR)")
    # Show our INFO lines once (absl may add a root handler later); orbax's INFO chatter stays hidden.
    if not log.handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        dtype = normalize_dtype(args.dtype)
        out = export_run(args.checkpoint, args.out, dtype=dtype, step=args.step, variant=args.variant)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

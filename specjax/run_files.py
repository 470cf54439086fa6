"""The names of the files and folders a training run writes under its run folder (run.output_dir),
and the paths built from them.

Every module that writes or reads a run folder (training, the run lock, the data pass, the
regeneration stage, decode_eval, export, checkpoints) takes its names from here, so one list says
what a run folder holds. Standard library only: export and the lock import it without pulling in
training.
"""
from __future__ import annotations

import os

# --- the run folder's top level ---------------------------------------------------------------
LOCK_FILE = "specjax.lock"  # the run's exclusive lock, holding its holder's pid, host and start time
WRITE_PROBE_FILE = ".write_probe.{pid}"  # written and removed at start, per process, to check the folder is writable
RUN_META_FILE = "run_meta.json"  # the run's config, draft config, target path and config, and vocab file name
RUN_META_KEPT_FILE = "run_meta.before_step{step}.json"  # the run_meta.json replaced by a resume that changed settings
VOCAB_FILE = "draft_vocab.npz"  # the draft vocabulary (d2t/t2d), built once and reused on every resume
SKIP_REPORT_FILE = "skipped_rows.jsonl"  # every training row the data pass skipped, one JSON object a line
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step and split
TENSORBOARD_DIR = "tensorboard"  # TensorBoard event files (when tensorboardX is installed)
CHECKPOINTS_DIR = "checkpoints"  # orbax checkpoints, one folder per saved step
EXPORT_DIR = "export"  # the head exported at the end of training, unless export.out_dir names another folder
REGENERATED_DIR = "regenerated"  # the regeneration stage's shards, unless regenerate.out_dir names another folder
REGEN_ROUNDS_DIR = "regen_rounds"  # regenerate.every_steps: each round's answers, shard-NNNNNN.parquet for round N
DECODE_EVAL_DIR = "decode_eval"  # decode_eval's heads and inference-server logs, one of each per evaluated step

# --- inside decode_eval/ ----------------------------------------------------------------------
DECODE_EVAL_HEAD_DIR = "step_{step}"  # the head exported for the evaluation at that step
DECODE_EVAL_SERVER_LOG = "step_{step}.server.log"  # the inference server's output for that evaluation

# --- inside checkpoints/<step>/ (orbax items) -------------------------------------------------
CHECKPOINT_STATE_ITEM = "state"  # the train state: draft params, optimizer state, step
CHECKPOINT_DATA_ITEM = "data_iter"  # the training data iterator's position
CHECKPOINT_META_ITEM = "meta"  # JSON: the step, the run's identity and the metrics at the save
CHECKPOINT_META_FILE = "metadata"  # the file orbax writes the meta item's JSON into
CHECKPOINT_CHECKSUMS_FILE = "specjax_checksums.json"  # size and sha256 of every file of the step folder

# --- inside checkpoints/ ----------------------------------------------------------------------
CHECKPOINT_MOVED_ASIDE_DIR = "{step}.{label}-{time}"  # a step folder that failed verification, kept for inspection


def run_meta_path(run_dir: str) -> str:
    return os.path.join(run_dir, RUN_META_FILE)


def run_meta_kept_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, RUN_META_KEPT_FILE.format(step=step))


def vocab_path(run_dir: str) -> str:
    return os.path.join(run_dir, VOCAB_FILE)


def metrics_path(run_dir: str) -> str:
    return os.path.join(run_dir, METRICS_FILE)


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS_DIR)


def checkpoint_meta_path(run_dir: str, step: int) -> str:
    """The meta item's JSON of checkpoint `step` of the run folder."""
    return os.path.join(run_dir, CHECKPOINTS_DIR, str(step), CHECKPOINT_META_ITEM, CHECKPOINT_META_FILE)


# --- the run report (specjax.report), rewritten at the end of every invocation -----------------
REPORT_FILE = "report.md"  # the run, its first/best/last validation, the plots and where the head stands
REPORT_LOSS_PLOT = "report_loss.png"  # train (raw and smoothed) and validation loss over steps
REPORT_ACC_PLOT = "report_acc.png"  # accuracy at each draft position (validation) over steps
REPORT_TAU_PLOT = "report_tau.png"  # predicted tau (train, validation) and decode_eval's measured tau over steps


def report_path(run_dir: str) -> str:
    return os.path.join(run_dir, REPORT_FILE)

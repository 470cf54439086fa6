"""Entry point: `python -m specjax.launch --config configs/X.yaml [section.key=value ...]`.

Parses the arguments and dispatches: --print-config, --compile-only (specjax.train.aot), or a
training run (specjax.train.loop.train, whose set-up is specjax.train.run.build_run), whose result
it prints as one JSON summary over the whole run, resumes included (`summary_of`), with the path of
the run report (specjax.report)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from specjax.config import ConfigError, describe_sections, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specjax.launch",
        description="Train an EAGLE-3 draft against a frozen JAX target, then export it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config sections (override any key with section.key=value):\n" + describe_sections(),
    )
    p.add_argument("--config", required=True, help="YAML config (may use `base: other.yaml`).")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 draft.ttt_steps=5")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--compile-only", action="store_true",
                   help="lower + compile the train step for the configured mesh from the target's config.json "
                        "(no weights, no data) and print per-device memory and FLOPs")
    p.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default=None,
                   help="with --compile-only: the platform to lower the step for (default: this host's). "
                        "tpu on a host without one lowers the step and every Pallas TPU kernel for a TPU "
                        "without compiling it (CPU devices stand in for the mesh's TPU devices) and prints "
                        "the kernels used and the per-device parameter and optimizer bytes")
    p.add_argument("--tpu-chip", default=None,
                   help="with --platform tpu: the TPU chip Mosaic's lowering is told it targets "
                        "(v4, v5e, v5p, v6e, 7x; default v6e)")
    p.add_argument("--devices", type=int, default=None,
                   help="with --platform tpu: the number of TPU devices to lower for (a parallelism.* size of -1 "
                        "fills them; default: the product of the fixed sizes)")
    return p


def _stand_in_cpu_devices(cfg, n_devices=None) -> None:
    """Lowering for a TPU from another host: give JAX as many CPU devices as the mesh needs, if JAX
    has not started its backends yet (otherwise the lowering's error says how to start it)."""
    import math

    import jax

    from specjax.mesh import MESH_AXES

    needed = n_devices or math.prod(max(int(getattr(cfg.parallelism, a)), 1) for a in MESH_AXES)
    if needed > 1 and jax.config.jax_num_cpu_devices < needed:
        try:
            jax.config.update("jax_num_cpu_devices", needed)
        except RuntimeError:  # backends already started: lowering_mesh reports the shortfall
            pass


def main(argv=None) -> int:
    args = _parser().parse_intermixed_args(argv)  # options may come between the overrides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from specjax.config import config_to_dict

        print(json.dumps(config_to_dict(cfg), indent=2))
        return 0

    if (args.platform or args.tpu_chip or args.devices) and not args.compile_only:
        print("error: --platform, --tpu-chip and --devices apply to --compile-only; add --compile-only.",
              file=sys.stderr)
        return 2
    if (args.tpu_chip or args.devices) and args.platform != "tpu":
        print("error: --tpu-chip and --devices describe the TPU to lower for; add --platform tpu.", file=sys.stderr)
        return 2
    if args.devices is not None and args.devices < 1:
        print(f"error: --devices {args.devices}: give the number of TPU devices, >= 1.", file=sys.stderr)
        return 2
    if args.platform == "tpu":
        _stand_in_cpu_devices(cfg, args.devices)

    from specjax.distributed import initialize

    initialize()
    if args.compile_only:
        from specjax.train.aot import compile_step, format_report

        try:
            print(format_report(compile_step(cfg, platform=args.platform, tpu_chip=args.tpu_chip,
                                             n_devices=args.devices)))
        except (ValueError, FileNotFoundError) as e:  # bad aux ids, draft/target mismatch, no config.json
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    from specjax.checkpoint import CheckpointMismatch, CheckpointSaveError
    from specjax.convert import ConvertError
    from specjax.regen.common import RegenerateError
    from specjax.train.loop import NonFiniteTrainingError, train

    try:
        result = train(cfg)  # the whole run: specjax.train.run.build_run, then the loop
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError, CheckpointMismatch,
            CheckpointSaveError, NonFiniteTrainingError, RegenerateError, ConvertError) as e:
        # known, user-fixable problems: the message names the problem and the fix
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.preempted:
        print(f"stopped at step {result.final_step} with a checkpoint in {result.output_dir}; "
              "run the same command again to resume.")
        if result.report_path:
            print(f"run report so far: {result.report_path}")
        return 0
    print(json.dumps(summary_of(result), indent=1))
    return 0


_SUMMARY_KEYS = ("step", "loss", "acc_0", "tau_sim", "acc", "accept_len")


def _pick(m: dict) -> dict:
    return {k: (m[k] if k == "step" else round(m[k], 4)) for k in _SUMMARY_KEYS if isinstance(m.get(k), (int, float))}


def summary_of(result) -> dict:
    """The end-of-run JSON summary. first / last (training) and val_first / val (validation) are over
    the whole run, every resume included, read from its metrics.jsonl (the later row where a resume
    re-logged a step); without that file (another process of a multi-host run), from this
    invocation's result. wall_time_s is this invocation's; wall_time_s_all_runs the whole run's when it
    was resumed."""
    from specjax.train.metrics import read_history

    try:
        hist = read_history(result.output_dir)
    except OSError:
        hist = None
    rows = (lambda split: hist.rows.get(split) if hist is not None else None)
    first = hist.first("train") if rows("train") else result.first_metrics
    last = hist.last("train") if rows("train") else result.last_metrics
    summary = {
        "output_dir": result.output_dir,
        "steps": result.final_step,
        "wall_time_s": round(result.wall_time_s, 1),
        "first": _pick(first),
        "last": _pick(last),
    }
    if rows("val"):
        summary["val_first"] = _pick(hist.first("val"))
        summary["val"] = _pick(hist.last("val"))
    else:
        summary["val"] = _pick(result.val_metrics)
    if hist is not None and len(hist.segments) > 1 and hist.wall_time_s is not None:
        summary["resumed_at"] = [s.start_step for s in hist.segments[1:]]
        summary["wall_time_s_all_runs"] = round(hist.wall_time_s, 1)
    summary["export_dir"] = result.export_dir
    if getattr(result, "report_path", None):
        summary["report"] = result.report_path
    decode = getattr(result, "decode_eval", None) or {}
    if decode:
        summary["decode_eval"] = decode.get(result.final_step, decode[max(decode)])
    return summary


if __name__ == "__main__":
    sys.exit(main())

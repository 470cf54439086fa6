"""Helpers to run training as a separate process (one CPU device) for kill/resume tests."""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml


def inprocess_config(target, out, *extra):
    """A small fp32 run on the tiny target for in-process train() calls (8 fake devices, batch 8);
    `extra` overrides are applied after these, so they win."""
    from specjax.config import load_config

    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=120",
        "data.seq_length=64", "data.batch_size=8", "data.val_fraction=0.0", "train.eval_batches=0",
        "draft.ttt_steps=2", "draft.draft_vocab_size=96", "train.steps=2", "train.log_every=1",
        "train.progress=false", "export.at_end=false", *extra,
    ])


def write_config(path, target, out_dir, **sections):
    cfg = {
        "run": {"output_dir": str(out_dir), "seed": 0},
        "target": {"path": target, "dtype": "float32"},
        "draft": {"ttt_steps": 2, "draft_vocab_size": 96},
        "data": {"train_files": ["pkg://specjax/assets/demo_chat.jsonl"], "max_rows": 160,
                 "seq_length": 64, "batch_size": 2, "val_fraction": 0.0},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.1},
        "train": {"steps": 24, "log_every": 1, "eval_every": 0, "eval_batches": 0, "progress": False},
        "checkpoint": {"every_steps": 4, "keep": 2},
        "export": {"at_end": True, "dtype": "float32"},
    }
    for sec, kv in sections.items():
        cfg.setdefault(sec, {}).update(kv)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return str(path)


_CACHE = os.path.join(tempfile.gettempdir(), f"specjax-test-jax-cache-{os.getuid()}")


def env():
    e = dict(os.environ)
    # restarts reuse compiled executables instead of recompiling the step every time
    e["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    e["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    e["JAX_PLATFORMS"] = "cpu"
    e["JAX_NUM_CPU_DEVICES"] = "1"  # XLA_FLAGS stays: conftest's compile-time flags (a cold child 22 s -> 14 s)
    return e


def launch(config_path, cwd):
    return subprocess.Popen([sys.executable, "-m", "specjax.launch", "--config", config_path],
                            cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(config_path, cwd, timeout=300):
    p = launch(config_path, cwd)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def count_train_rows(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if b'"split": "train"' in line)


def wait_for_rows(out_dir, n, proc, timeout=240):
    t0 = time.time()
    while count_train_rows(out_dir) < n:
        if proc.poll() is not None:
            return False
        if time.time() - t0 > timeout:
            raise TimeoutError(f"no progress in {out_dir}")
        time.sleep(0.05)
    return True


def exported_tensors(out_dir):
    from safetensors.numpy import load_file

    return load_file(os.path.join(out_dir, "export", "model.safetensors"))


def assert_same_tensors(a, b, atol=0.0):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=0, err_msg=k)


def small_state(step, width=4):
    """A train state of a tiny draft (a [width, 3] weight, Adam), its step counter set to `step`; the
    weight is filled with `step`, so a restored state tells which checkpoint it came from."""
    import jax.numpy as jnp
    import optax

    from specjax.train.step import init_state

    state = init_state({"w": jnp.full((width, 3), float(step), jnp.float32)}, optax.adam(1e-3))
    return dict(state, step=jnp.asarray(step, jnp.int32))


def small_abstract_state(width=4):
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                  small_state(0, width))


def save_small_checkpoints(directory, steps, keep=3):
    """Checkpoints of `small_state(step)` at each of `steps` in `directory`, as specjax saves them
    (with their checksum lists)."""
    from specjax import checkpoint as ckpt

    mngr = ckpt.manager(str(directory), keep=keep)
    for step in steps:
        ckpt.save(mngr, step, small_state(step), meta={"step": step})
    return mngr


def check_exported_block_head(run, head, target, *, family, layout, config_type, prompt, num_spec_tokens=3):
    """What a trained block-draft run (DFlash's serving form) must give: run_meta.json names `family`;
    the export at the end passes the validator as `layout`; specjax.eval reads it back as `config_type`
    with `num_spec_tokens` draft tokens and decodes `prompt` losslessly (12 tokens, greedy); serve_cmd
    prints vLLM's dflash method; `python -m specjax.export` re-exports the run from its checkpoint with
    the same tensors. Returns the re-export's folder."""
    import json

    from safetensors.numpy import load_file

    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.export import export_run
    from specjax.serve_cmd import build
    from specjax.targets.loading import load_target
    from specjax_converters.head_formats import errors, validate_folder

    with open(os.path.join(run, "run_meta.json")) as f:
        assert json.load(f)["draft_family"] == family
    findings, info = validate_folder(head, target=target)
    assert info["layout"] == layout and not errors(findings), [str(f) for f in findings]

    draft = load_draft(head)
    assert type(draft.config) is config_type and draft.config.num_draft_tokens == num_spec_tokens
    tgt = load_target(target, dtype="float32")
    greedy = generate(tgt, [prompt], max_new_tokens=12)[0][:12]
    assert SpecDecoder(tgt, draft, num_spec_tokens=num_spec_tokens).generate(prompt, max_new_tokens=12).tokens == greedy

    code, text = build(head, target, engine="vllm")
    assert code == 0 and '"method": "dflash"' in text and f'"num_speculative_tokens": {num_spec_tokens}' in text, text

    again = export_run(str(run), os.path.join(os.path.dirname(str(run)), "again"), dtype="float32")
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (head, again))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)
    return again

"""`python -m specjax.launch --config X --compile-only --platform tpu` lowers the whole train step
(target forward, teacher, K-step TTT, AdamW) for a TPU from this CPU host, with the Pallas TPU kernels,
on one device and on an 8-device mesh (fsdp 4 x tensor 2; the 8 fake CPU devices stand in for TPU
devices), for a Llama-3.1-8B-, a Qwen3-30B-A3B- and a Nemotron-H-30B-A3B-shaped target at full width and
reduced depth (4 layers; Nemotron-H: Mamba, attention, MoE, Mamba). Only config.json files are written.

Each case is lowered once (module-scoped fixture, ~2-4 s each, nothing compiled) and its printed report
is checked: the kernels chosen, the Mosaic calls per kernel name in the lowered module (so an XLA
fallback cannot pass), the chip Mosaic's lowering was told about, and the per-device bytes the
shardings determine. The Llama one-device case runs with every kernel on `auto`, which on a TPU picks
pallas_tpu; the others name pallas_tpu for every kernel that has one (ssd has none)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from specjax.launch import main
from specjax.targets.llama import hf_config_dict

TTT_STEPS = 7
LAYERS = 4
MESHES = {"1dev": "  data: 1\n", "8dev": "  data: -1\n  fsdp: 4\n  tensor: 2\n"}  # 8dev: --devices 8


def _llama():
    return hf_config_dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                          intermediate_size=14336, num_hidden_layers=LAYERS, num_attention_heads=32,
                          num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                          rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          dtype="bfloat16")


def _shipped(name, **changes):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "configs", "targets", name, "config.json")) as f:
        hf = json.load(f)
    hf.update(changes, num_hidden_layers=LAYERS)
    return hf


# name -> (config.json, attention layers in the target, has MoE experts)
TARGETS = {
    "llama": (_llama, LAYERS, False),
    "qwen3_moe": (lambda: _shipped("qwen3_30b_a3b"), LAYERS, True),
    "nemotron_h": (lambda: _shipped("nemotron_h_30b_a3b", hybrid_override_pattern="M*EM"), 1, True),
}
CASES = [(t, m) for t in TARGETS for m in MESHES]


def _write_run(tmp, target, mesh, kernels):
    tdir = tmp / target
    tdir.mkdir(exist_ok=True)
    (tdir / "config.json").write_text(json.dumps(TARGETS[target][0]()))
    cfg = tmp / f"{target}_{mesh}.yaml"
    cfg.write_text(f"target:\n  path: {tdir}\n  dtype: bfloat16\n  aux_layer_ids: [0, 1, 2]\n"
                   f"draft:\n  draft_vocab_size: 32000\n  ttt_steps: {TTT_STEPS}\n"
                   f"data:\n  seq_length: 4096\n  batch_size: 8\nkernels:\n{kernels}"
                   f"parallelism:\n{MESHES[mesh]}")
    return str(cfg)


def _auto(target, mesh):
    return target == "llama" and mesh == "1dev"


def _launch(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-{m}" for t, m in CASES])
def lowered(request, tmp_path_factory):
    target, mesh = request.param
    kernels = "  ttt_attention: auto\n" if _auto(target, mesh) else (
        "  ttt_attention: pallas_tpu\n  soft_ce: pallas_tpu\n  target_attention: pallas_tpu\n"
        + ("  moe: pallas_tpu\n" if TARGETS[target][2] else ""))
    cfg = _write_run(tmp_path_factory.mktemp("tpu"), target, mesh, kernels)
    rc, out, err = _launch(["--config", cfg, "--compile-only", "--platform", "tpu"]
                           + (["--devices", "8"] if mesh == "8dev" else []))
    assert rc == 0, err
    return target, mesh, out, json.loads(out.strip().splitlines()[-1])


def test_step_lowers_with_the_pallas_tpu_kernels(lowered):
    target, mesh, out, report = lowered
    assert report["platform"] == "tpu" and report["compiled"] is False
    assert report["tpu_chip"] == "v6e" and report["tpu_device_kind"] == "TPU v6 lite"
    assert report["devices"] == (1 if mesh == "1dev" else 8) and report["batch"] == [8, 4096]
    assert (report["mesh"]["fsdp"], report["mesh"]["tensor"]) == ((1, 1) if mesh == "1dev" else (4, 2))
    assert report["kernels"]["ttt_attention"] == ["pallas_tpu"] and report["kernels"]["soft_ce"] == ["pallas_tpu"]
    assert report["kernels"]["target_attention"] == ["ttt_attention kernel"]
    if TARGETS[target][2]:
        assert report["kernels"]["moe"] == ["pallas_tpu"]
    m = report["mosaic_kernels"]
    # call sites in the module: draft, K forward attention calls and K backward pairs; target, one
    # forward per attention layer (at this depth with taps 0, 1, 2 every layer is its own scan segment);
    # soft CE, K stats calls and K (row chunks of) dlogits
    assert m["ttt_block0_fwd_tpu"] == TTT_STEPS + TARGETS[target][1]
    assert m["ttt_block0_dq_tpu"] == m["ttt_block0_dkdv_tpu"] == TTT_STEPS
    assert m["soft_ce_stats_tpu"] == TTT_STEPS and m["soft_ce_dlogits_tpu"] >= TTT_STEPS
    assert report["mosaic_calls"] == sum(m.values())
    assert "lowered for tpu (chip v6e" in out and "kernels: " in out and "not known without compiling" in out


def test_report_gives_per_device_bytes(lowered):
    target, mesh, _, report = lowered
    draft, opt = report["draft_param_bytes_per_device"], report["optimizer_state_bytes_per_device"]
    assert draft > 0 and opt >= 2 * draft  # AdamW: two moments per parameter
    assert report["target_param_bytes_per_device"] > 0 and report["batch_bytes_per_device"] > 0
    assert "XLA's memory and cost analyses need an XLA:TPU compile" in report["not_known"]
    assert "temp_size_in_bytes" not in report and "flops_per_step" not in report  # not invented


def test_devices_hold_their_share_of_the_draft(lowered):
    target, mesh, _, report = lowered
    whole = report["draft_params"] * 4  # float32 draft parameters
    if mesh == "1dev":
        assert report["draft_param_bytes_per_device"] == whole
    else:  # fsdp 4 x tensor 2 (a few small leaves stay replicated)
        assert report["draft_param_bytes_per_device"] < whole / 4


def test_moe_experts_lower_as_mosaic(lowered):
    """kernels.moe=pallas_tpu inside the step: megablox's gmm is a Mosaic call (not Pallas's
    interpreter) when lowered for a TPU from this CPU host, on one device and under shard_map on 8."""
    target, mesh, _, report = lowered
    if not TARGETS[target][2]:
        pytest.skip("no MoE experts in this target")
    others = {k: v for k, v in report["mosaic_kernels"].items() if not k.startswith(("ttt_", "soft_ce_"))}
    # megablox gmm, its pallas_call named "kernel": gate/up and down (the target is frozen: no tgmm)
    assert sum(others.values()) >= 2, report["mosaic_kernels"]


def test_cli_errors(tmp_path):
    cfg = _write_run(tmp_path, "llama", "1dev", "  ttt_attention: auto\n")
    rc, _, err = _launch(["--config", cfg, "--platform", "tpu"])
    assert rc == 2 and "add --compile-only" in err
    rc, _, err = _launch(["--config", cfg, "--compile-only", "--tpu-chip", "v5e"])
    assert rc == 2 and "add --platform tpu" in err
    rc, _, err = _launch(["--config", cfg, "--compile-only", "--platform", "tpu", "--tpu-chip", "v9"])
    assert rc == 1 and "unknown TPU chip 'v9'" in err
    rc, _, err = _launch(["--config", cfg, "--compile-only", "--platform", "gpu"])
    assert rc == 1 and "only a TPU step can be lowered" in err
    rc, _, err = _launch(["--config", cfg, "--compile-only", "--devices", "8"])
    assert rc == 2 and "add --platform tpu" in err
    rc, _, err = _launch(["--config", cfg, "--compile-only", "--platform", "tpu", "--devices", "64"])
    assert rc == 1 and "xla_force_host_platform_device_count=64" in err  # JAX started with 8 CPU devices


def test_split_kernels_train_like_xla_on_the_cpu_mesh():
    """The same split the TPU lowering uses, run: one train step on the 8 CPU devices (fsdp 4 x tensor
    2) with the pallas_tpu TTT attention and soft CE (Pallas's interpreter under shard_map) gives the
    loss, gradient norm and updated draft of the xla kernels on that mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import mesh as meshlib
    from specjax.config import OptimConfig
    from specjax.drafts import eagle3
    from specjax.drafts.ttt import TTTConfig
    from specjax.targets.llama import LlamaTarget, LlamaTargetConfig
    from specjax.train.optim import make_optimizer
    from specjax.train.step import BATCH_KEYS, build_step_fns, init_state

    cfg = LlamaTargetConfig.create(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    target = LlamaTarget.init(cfg, jax.random.key(0), jnp.float32)
    dcfg = eagle3.config_from_target(cfg, draft_vocab_size=128, aux_layer_ids=(0, 1, 2))
    params = eagle3.init_draft_params(dcfg, jax.random.key(1), std=0.05)
    rng = np.random.default_rng(0)
    B, T = 8, 128
    seg = np.ones((B, T), np.int32)
    seg[:, 70:] = 2
    seg[::2, 120:] = 0
    pos = np.where(np.arange(T) < 70, np.arange(T), np.arange(T) - 70).astype(np.int32) * np.ones((B, 1), np.int32)
    batch = {"input_ids": rng.integers(0, 256, (B, T)).astype(np.int32),
             "loss_mask": (rng.random((B, T)) > 0.2).astype(np.int32) * (seg > 0), "segment_ids": seg, "positions": pos}
    draft_ids = np.sort(rng.choice(256, 128, replace=False))
    vocab = {"draft_ids": jnp.asarray(draft_ids, jnp.int32), "t2d": jnp.zeros(256, bool).at[draft_ids].set(True),
             "d2t": jnp.asarray(draft_ids - np.arange(128), jnp.int32)}
    mesh = meshlib.make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, jax.devices()[:8])
    opt = make_optimizer(OptimConfig(lr=1e-4, warmup_ratio=0.0), 10)

    def step(impl):
        ttt = TTTConfig(ttt_steps=2, vocab_chunk=64, attention_impl=impl, soft_ce_impl=impl)
        fns = build_step_fns(target, target.params, params, dcfg, ttt, opt, mesh)
        fresh = jax.tree_util.tree_map(np.array, init_state(params, opt))  # the step donates its state
        args = (jax.device_put(fresh, fns.state_shardings), jax.device_put(target.params, fns.target_shardings),
                jax.device_put(vocab, fns.vocab_shardings),
                {k: jax.device_put(batch[k], fns.batch_sharding) for k in BATCH_KEYS})
        # -O0: LLVM's optimisation of the CPU code is skipped (half the compile time; same numbers)
        compiled = fns.train_step.lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})
        state, m = compiled(*args)
        return (float(m["loss"]), float(m["grad_norm"])), jax.device_get(state["params"])

    (got, p), (ref, p_ref) = step("pallas_tpu"), step("xla")
    np.testing.assert_allclose(got, ref, rtol=2e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), p, p_ref)

"""The EAGLE-3 export (specjax_converters.eagle3_export, specjax.export): layout and config per
docs/eagle3-format.md ("Checkpoint layout", "config.json keys"), loadability in SpecForge's draft
class, the CLI on a run folder, and that a rejected export writes nothing."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from specjax.drafts import eagle3
from specjax.drafts.ttt import shift_left
from specjax.drafts.vocab import DraftVocab
from specjax.targets.llama import LlamaTargetConfig, hf_config_dict
from specjax_converters.eagle3_export import export_eagle3

H, N_HEADS, N_KV, HEAD_DIM, INTER, V, VD, L = 64, 4, 2, 16, 128, 300, 120, 6
AUX = (1, 2, 3)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# docs/eagle3-format.md, "Checkpoint layout", written out here rather than derived from the exporter.
EXPECTED_SHAPES = {
    "fc.weight": (H, 3 * H),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (N_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.k_proj.weight": (N_KV * HEAD_DIM, 2 * H),
    "midlayer.self_attn.v_proj.weight": (N_KV * HEAD_DIM, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, N_HEADS * HEAD_DIM),
    "midlayer.mlp.gate_proj.weight": (INTER, H),
    "midlayer.mlp.up_proj.weight": (INTER, H),
    "midlayer.mlp.down_proj.weight": (H, INTER),
    "norm.weight": (H,),
    "lm_head.weight": (VD, H),
    "d2t": (VD,),
    "t2d": (V,),
}


def make_draft(seed=0, rope_parameters=LLAMA3_ROPE):
    target_hf = hf_config_dict(
        vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV, head_dim=HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_parameters=rope_parameters,
    )
    target_hf.update(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    cfg = eagle3.config_from_target(LlamaTargetConfig.from_hf(target_hf), draft_vocab_size=VD, aux_layer_ids=AUX)
    params = eagle3.init_draft_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    vocab = DraftVocab.from_ids(rng.choice(V, VD, replace=False), V)
    return target_hf, cfg, params, vocab


def read_safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_export_layout_config_and_manifest(tmp_path):
    target_hf, cfg, params, vocab = make_draft()
    out = tmp_path / "export"
    export_eagle3(params, cfg, vocab, target_hf, out, dtype="bfloat16", extra_manifest={"step": 7})
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temp folders left behind
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "specjax_manifest.json"]

    header = read_safetensors_header(out / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {k: tuple(v["shape"]) for k, v in header.items()} == EXPECTED_SHAPES
    dtypes = {k: v["dtype"] for k, v in header.items()}
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}

    from safetensors.numpy import load_file

    w = load_file(out / "model.safetensors")
    bf16 = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    np.testing.assert_array_equal(w["fc.weight"], bf16(params["fc"]["kernel"]).T)
    np.testing.assert_array_equal(w["midlayer.self_attn.q_proj.weight"],
                                  bf16(params["midlayer"]["self_attn"]["q_proj"]["kernel"]).T)
    np.testing.assert_array_equal(w["lm_head.weight"], bf16(params["lm_head"]["kernel"]).T)
    np.testing.assert_array_equal(w["norm.weight"], bf16(params["norm"]["scale"]))
    np.testing.assert_array_equal(w["d2t"], vocab.d2t)
    np.testing.assert_array_equal(w["t2d"], vocab.t2d)
    np.testing.assert_array_equal(np.flatnonzero(w["t2d"]), np.arange(VD) + w["d2t"])

    conf = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "tie_word_embeddings": False, "hidden_size": H, "intermediate_size": INTER,
        "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "vocab_size": V, "draft_vocab_size": VD, "target_hidden_size": H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [2, 3, 4], "norm_before_residual": False, "norm_output": False,
        "rope_theta": 500000.0, "rope_parameters": LLAMA3_ROPE,
        "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0,
    }
    assert {k: conf.get(k) for k in expected} == expected

    assert "fc_norm" not in conf  # only EAGLE-3.1 exports carry the flag
    assert "target_layer_count" not in conf  # only looped targets need it

    manifest = json.loads((out / "specjax_manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["dtype"] == "bfloat16" and manifest["variant"] == "eagle3"
    canonical = json.dumps(target_hf, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["target_config_sha256"] == hashlib.sha256(canonical).hexdigest()
    assert manifest["target_config"] == target_hf and manifest["draft_config"]["aux_layer_ids"] == list(AUX)
    assert manifest["warnings"] == []
    for name in ("model.safetensors", "config.json"):
        assert manifest["files"][name]["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()


def test_default_rope_writes_null_rope_scaling(tmp_path):
    target_hf, cfg, params, vocab = make_draft(rope_parameters=None)
    export_eagle3(params, cfg, vocab, target_hf, tmp_path / "e", dtype="fp32")
    conf = json.loads((tmp_path / "e" / "config.json").read_text())
    assert conf["rope_scaling"] is None and conf["rope_theta"] == 10000.0 and conf["torch_dtype"] == "float32"
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


@functools.partial(jax.jit, static_argnums=(1, 6), compiler_options={"xla_backend_optimization_level": 0})
def _jax_logits(params, cfg, x, aux, embed, positions, n_steps):
    """Draft logits for TTT steps 0..n_steps-1 (jitted once: eager ops would each compile)."""
    h = eagle3.project_aux(params, aux, cfg)
    seg = jnp.ones(x.shape, jnp.int32)
    cache, out = [], []
    for k in range(n_steps):
        h, kv = eagle3.decoder_layer(params, cfg, jnp.take(embed, shift_left(x, 1 + k), axis=0), h, positions,
                                     seg, cache)
        cache.append(kv)
        out.append(eagle3.draft_logits(params, cfg, h))
    return out


def test_export_loads_into_specforge(tmp_path):
    """model.safetensors + config.json -> SpecForge's LlamaForCausalLMEagle3 (strict load, embedding added)
    gives the JAX draft's logits. bf16 is checked against JAX run on the same bf16-rounded params."""
    pytest.importorskip("torch")
    pytest.importorskip("specforge")
    from safetensors.torch import load_file

    from parity._specforge import build_draft, rel_err, run_draft_steps, to_torch, torch

    target_hf, cfg, params, vocab = make_draft(seed=3)
    B, T, K = 2, 16, 3
    rng = np.random.default_rng(3)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    aux = tuple(rng.standard_normal((B, T, H)).astype(np.float32) for _ in range(3))
    embed = (0.5 * rng.standard_normal((V, H))).astype(np.float32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()

    step_ids = [to_torch(shift_left(jnp.asarray(x), 1 + k)).long() for k in range(K)]
    torch_in = (torch.from_numpy(np.concatenate(aux, axis=-1)), step_ids, torch.from_numpy(positions).long())
    jax_in = (jnp.asarray(x), tuple(jnp.asarray(a) for a in aux), jnp.asarray(embed), jnp.asarray(positions), K)
    ours = [np.asarray(a) for a in _jax_logits(params, cfg, *jax_in)]
    rounded = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params)
    ours_bf16 = [np.asarray(a) for a in _jax_logits(rounded, cfg, *jax_in)]

    errs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        export_eagle3(params, cfg, vocab, target_hf, out, dtype=dtype)
        conf = json.loads((out / "config.json").read_text())
        sd = load_file(out / "model.safetensors")
        draft = build_draft(conf, sd, embed)  # strict=True; embed_tokens is the target's, not exported
        assert torch.equal(draft.d2t, to_torch(vocab.d2t)) and torch.equal(draft.t2d, to_torch(vocab.t2d))
        ref = run_draft_steps(draft, *torch_in)
        expected = ours if dtype == "float32" else ours_bf16
        errs[dtype] = max(rel_err(a, b) for a, b in zip(expected, ref))
    errs["bf16 export vs fp32 JAX"] = max(rel_err(a, b) for a, b in zip(ours, ours_bf16))
    print("export -> SpecForge logits, max|diff|/max|ref|:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert errs["float32"] <= 1e-5
    assert errs["bfloat16"] <= 1e-5  # same bf16 values on both sides, computed in fp32
    assert errs["bf16 export vs fp32 JAX"] <= 1e-2  # the rounding itself (measured 2.2e-3 here)


def _fake_run(run_dir, cfg, target_hf, vocab, params_by_step):
    """A run folder like specjax.train.loop writes: run_meta.json, draft_vocab.npz, orbax checkpoints."""
    import optax

    from specjax import checkpoint as ckpt
    from specjax.train.step import init_state

    os.makedirs(run_dir)
    meta = {"draft_config": eagle3.config_to_dict(cfg), "target_config": target_hf,
            "target_path": "/nonexistent/target", "vocab_file": "draft_vocab.npz", "config": {"run": {"seed": 0}}}
    with open(os.path.join(run_dir, "run_meta.json"), "w") as f:
        json.dump(meta, f)
    vocab.save(os.path.join(run_dir, "draft_vocab.npz"))
    mngr = ckpt.manager(os.path.join(run_dir, "checkpoints"))
    for step, params in params_by_step.items():
        state = init_state(params, optax.adamw(1e-3))
        state["step"] = jnp.asarray(step, jnp.int32)
        ckpt.save(mngr, step, state, meta={"step": step, "metrics": {"loss": 10.0 - step}})


def test_export_cli_from_run_folder(tmp_path, capsys):
    from safetensors.numpy import load_file

    from specjax.export import main

    target_hf, cfg, params, vocab = make_draft(seed=1)
    later = jax.tree_util.tree_map(lambda p: p + 1.0, params)
    run = tmp_path / "run"
    _fake_run(str(run), cfg, target_hf, vocab, {3: params, 5: later})

    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "latest"), "--dtype", "fp32"]) == 0
    w = load_file(tmp_path / "latest" / "model.safetensors")
    np.testing.assert_array_equal(w["fc.weight"], np.asarray(later["fc"]["kernel"]).T)  # latest step
    np.testing.assert_array_equal(w["midlayer.mlp.down_proj.weight"],
                                  np.asarray(later["midlayer"]["mlp"]["down_proj"]["kernel"]).T)
    np.testing.assert_array_equal(w["t2d"], vocab.t2d)
    manifest = json.loads((tmp_path / "latest" / "specjax_manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["source_run"] == str(run) and manifest["dtype"] == "float32"
    assert manifest["metrics"] == {"loss": 5.0} and manifest["config"] == {"run": {"seed": 0}}  # step 5's
    assert manifest["target_path"] == "/nonexistent/target" and manifest["variant"] == "eagle3"

    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "s3"), "--step", "3"]) == 0
    w = load_file(tmp_path / "s3" / "model.safetensors")
    assert w["lm_head.weight"].dtype == ml_dtypes.bfloat16  # bf16 is the default
    np.testing.assert_array_equal(w["lm_head.weight"],
                                  np.asarray(params["lm_head"]["kernel"]).astype(ml_dtypes.bfloat16).T)

    capsys.readouterr()
    assert main(["--checkpoint", str(run / "checkpoints"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "not a specjax run folder" in err and f"did you mean {run}" in err
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "x"), "--step", "4"]) == 2
    assert "available steps: [3, 5]" in capsys.readouterr().err
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "x"), "--dtype", "int8"]) == 2
    assert main(["--checkpoint", str(run), "--out", str(tmp_path / "x"), "--variant", "eagle3.1"]) == 2
    assert "variant: --variant eagle3.1 but the draft was trained as eagle3" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("problem", ["t2d_mismatch", "d2t_int32", "wrong_draft_vocab_size", "target_vocab"])
def test_invalid_export_raises_and_writes_nothing(tmp_path, problem):
    target_hf, cfg, params, vocab = make_draft(seed=2)
    d2t, t2d = vocab.d2t.copy(), vocab.t2d.copy()
    if problem == "t2d_mismatch":  # a draft id dropped from t2d: engines would map tokens wrongly
        t2d[vocab.draft_ids[5]] = False
        t2d[np.flatnonzero(~t2d)[0]] = True
    elif problem == "d2t_int32":
        d2t = d2t.astype(np.int32)
    elif problem == "wrong_draft_vocab_size":
        other = DraftVocab.from_ids(np.arange(VD - 20), V)
        d2t, t2d = other.d2t, other.t2d
    else:  # a vocab built for another target
        target_hf = dict(target_hf, vocab_size=V + 8)
    bad = SimpleNamespace(d2t=d2t, t2d=t2d)  # DraftVocab itself refuses to hold such arrays
    with pytest.raises(ValueError, match=r"EAGLE-3 export: (d2t|t2d)"):
        export_eagle3(params, cfg, bad, target_hf, tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_export_replaces_an_earlier_export_but_not_other_folders(tmp_path):
    target_hf, cfg, params, vocab = make_draft(seed=2)
    out = tmp_path / "out"
    export_eagle3(params, cfg, vocab, target_hf, out, dtype="fp32", extra_manifest={"step": 1})
    export_eagle3(params, cfg, vocab, target_hf, out, dtype="fp32", extra_manifest={"step": 2})
    assert json.loads((out / "specjax_manifest.json").read_text())["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["out"]

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="out_dir"):
        export_eagle3(params, cfg, vocab, target_hf, other)
    assert os.listdir(other) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["notes", "out"]

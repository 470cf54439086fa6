"""specjax.targets vs transformers (PyTorch) on tiny random Llama / Qwen3 checkpoints.

Parity metric: rel = max|ours - ref| / max|ref|, required <= 1e-4 (fp32 on CPU) for the logits,
the final hidden state and each aux hidden state (aux id k <-> HF hidden_states[k+1]).
Weights are re-drawn with larger scales than HF's init (std 0.02) so attention is far from uniform
and RoPE / norm-weight / head-layout mistakes change the outputs well beyond the tolerance.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    TargetOutput,
    default_aux_layer_ids,
    get_target_class,
    load_target,
)
from specjax.targets import llama  # noqa: E402
from specjax.layers.rope import RopeSpec, inverse_frequencies, rope_spec_from_hf  # noqa: E402

from eval._models import peak_weights_  # noqa: E402
from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB, HIDDEN, MLP = 256, 64, 128
AUX = (0, 2, 3)  # for 5..6 layer models: tap first, middle and a late (not last) layer


def _make_hf(config, tmp_path, name, seed=0, **save_kw):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_(model, seed)  # matrices std 0.15, embeddings std 0.5, norm weights 1 + 0.2 * N(0, 1)
    out = tmp_path / name
    model.save_pretrained(str(out), **save_kw)
    return model, str(out)


def _llama_cfg(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=5,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _qwen3_cfg(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=4096)
    base.update(kw)
    return transformers.Qwen3Config(**base)


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


def _hf_forward(model, ids, positions=None):
    """HF outputs plus ``last_layer_out``: the last decoder layer's output *before* the final norm
    (HF replaces hidden_states[-1] with the post-norm state, so aux id L-1 needs a hook)."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            kw = {} if positions is None else {"position_ids": torch.tensor(positions, dtype=torch.long)}
            out = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True, **kw)
    finally:
        hook.remove()
    out.last_layer_out = captured["h"]
    return out


def _hf_aux(ref, k, num_layers):
    return (ref.last_layer_out if k == num_layers - 1 else ref.hidden_states[k + 1]).numpy()


def _check_parity(target, model, ids, aux=AUX, positions=None) -> dict[str, float]:
    out = target(ids, aux_layer_ids=aux, positions=positions)
    assert isinstance(out, TargetOutput)
    ref = _hf_forward(model, ids, positions)
    errs = {"logits": rel_err(out.logits, ref.logits.numpy()),
            # HF's last hidden_states entry is the post-final-norm state == our final_hidden.
            "final_hidden": rel_err(out.final_hidden, ref.hidden_states[-1].numpy())}
    assert out.logits.dtype == jnp.float32 and out.logits.shape == ids.shape + (VOCAB,)
    assert len(out.aux_hidden) == len(aux)
    for k, a in zip(aux, out.aux_hidden):
        errs[f"aux{k}"] = rel_err(a, _hf_aux(ref, k, target.num_layers))
    print({k: f"{v:.2e}" for k, v in errs.items()})
    for k, v in errs.items():
        assert v <= REL_TOL, f"{k}: rel err {v:.3e} > {REL_TOL}"
    return errs


# ---------------------------------------------------------------------------------------------
# Fixtures: one saved checkpoint per variant, shared across tests in this module.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory):
    return tmp_path_factory.mktemp("targets")


@pytest.fixture(scope="module")
def llama_untied(tmp_mod):
    return _make_hf(_llama_cfg(), tmp_mod, "llama_untied", seed=1)


@pytest.fixture(scope="module")
def qwen3(tmp_mod):
    return _make_hf(_qwen3_cfg(), tmp_mod, "qwen3", seed=4)


# ---------------------------------------------------------------------------------------------
# Parity cases
# ---------------------------------------------------------------------------------------------
def test_llama_untied_parity(llama_untied):
    model, path = llama_untied
    target = load_target(path, dtype="float32")
    assert target.arch == "LlamaForCausalLM" and "lm_head" in target.params
    assert target.params["layers"]["self_attn"]["q_proj"]["kernel"].shape == (5, HIDDEN, HIDDEN)
    _check_parity(target, model, _ids(2, 24))


def test_llama_tied_parity(tmp_mod):
    model, path = _make_hf(_llama_cfg(tie_word_embeddings=True), tmp_mod, "llama_tied", seed=2)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        assert "lm_head.weight" not in f.keys()
    target = load_target(path, dtype="float32")
    assert "lm_head" not in target.params
    np.testing.assert_array_equal(target.lm_head_weight(target.params), target.embed_table(target.params))
    _check_parity(target, model, _ids(2, 20, seed=1))


def test_llama3_rope_scaling_parity(tmp_mod):
    # original context 64 with head_dim 16: wavelengths above 64 are divided by `factor`, those in
    # 16..64 are blended, so positions in the hundreds differ a lot from unscaled RoPE.
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model, path = _make_hf(_llama_cfg(rope_parameters=rope), tmp_mod, "llama3_rope", seed=3)
    target = load_target(path, dtype="float32")
    assert target.config.rope == RopeSpec("llama3", 10000.0, 8.0, 1.0, 4.0, 64)
    ids = _ids(2, 32, seed=2)
    positions = np.broadcast_to(np.arange(32, dtype=np.int32) + 700, (2, 32)).copy()
    _check_parity(target, model, ids, positions=positions)
    # The scaling must matter at these positions (guards against a vacuous comparison): the
    # rotation angles move by radians, not rounding noise.
    scaled = inverse_frequencies(target.config.rope, 16)
    plain = inverse_frequencies(RopeSpec("default", 10000.0), 16)
    assert np.abs(731 * (scaled - plain)).max() > 1.0 and scaled[0] == plain[0]


def test_linear_rope_parity(tmp_mod):
    rope = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}
    model, path = _make_hf(_llama_cfg(rope_parameters=rope, num_hidden_layers=4), tmp_mod, "llama_linear", seed=5)
    target = load_target(path, dtype="float32")
    assert target.config.rope == RopeSpec("linear", 5000.0, factor=4.0)
    _check_parity(target, model, _ids(1, 24, seed=3), aux=(1, 2))


def test_qwen3_parity(qwen3):
    model, path = qwen3
    target = load_target(path, dtype="float32")
    cfg = target.config
    assert target.arch == "Qwen3ForCausalLM" and cfg.qk_norm
    assert cfg.head_dim == 24 != HIDDEN // cfg.num_attention_heads and cfg.num_key_value_heads == 2
    assert target.params["layers"]["self_attn"]["q_norm"]["scale"].shape == (6, 24)
    # Tap L-1 too: our aux id L-1 is the pre-final-norm stream (HF hook), not hidden_states[L].
    _check_parity(target, model, _ids(2, 24, seed=4), aux=(0, 3, 5))


# ---------------------------------------------------------------------------------------------
# Packing, sharding, chunked attention
# ---------------------------------------------------------------------------------------------
def test_packed_segments_match_separate_documents(qwen3):
    _, path = qwen3
    target = load_target(path, dtype="float32")
    aux = (1, 3, 4)
    n, pad = 13, 6  # both documents have n tokens so their solo runs share one batch / compile
    docs = _ids(2, n, seed=6)
    packed = np.concatenate([docs[:1], docs[1:], np.zeros((1, pad), np.int32)], axis=1)
    segment_ids = np.array([[1] * n + [2] * n + [0] * pad], np.int32)
    positions = np.array([list(range(n)) * 2 + [0] * pad], np.int32)
    out = target(packed, aux_layer_ids=aux, positions=positions, segment_ids=segment_ids)
    alone = target(docs, aux_layer_ids=aux)  # row j = document j on its own
    for j, sl in enumerate((slice(0, n), slice(n, 2 * n))):
        assert rel_err(out.logits[0, sl], alone.logits[j]) <= 1e-5
        for a, b in zip(out.aux_hidden, alone.aux_hidden):
            assert rel_err(a[0, sl], b[j]) <= 1e-5
    assert np.isfinite(np.asarray(out.logits)).all()  # padding rows must not produce NaNs
    # Without the segment mask the second document would see the first: the check is not vacuous.
    leaky = target(packed, aux_layer_ids=aux, positions=positions, segment_ids=np.ones_like(segment_ids))
    assert rel_err(leaky.logits[0, n:2 * n], alone.logits[1]) > 1e-2


def test_query_blocked_attention_matches(llama_untied):
    _, path = llama_untied
    ids = _ids(2, 32, seed=8)
    full = load_target(path, dtype="float32")(ids)
    blocked = load_target(path, dtype="float32", attention_q_block=8)(ids)
    assert rel_err(blocked.logits, full.logits) <= 1e-5  # same math, fp32 reordering only
    for a, b in zip(blocked.aux_hidden, full.aux_hidden):
        assert rel_err(a, b) <= 1e-5


def test_load_with_shardings(llama_untied):
    model, path = llama_untied
    cls = get_target_class("LlamaForCausalLM")
    axes = load_target(path, dtype="float32").param_logical_axes()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
    rules = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    shardings = jax.tree.map(
        lambda ax: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(rules.get(a) for a in ax))),
        axes, is_leaf=lambda x: isinstance(x, tuple),
    )
    target = load_target(path, dtype="float32", shardings=shardings)
    assert isinstance(target, cls)
    q = target.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    _check_parity(target, model, _ids(2, 16, seed=9))


# ---------------------------------------------------------------------------------------------
# Checkpoint formats and errors
# ---------------------------------------------------------------------------------------------
def test_sharded_checkpoint_and_missing_shard(tmp_mod, llama_untied):
    model, _ = llama_untied
    path = str(tmp_mod / "llama_sharded")
    model.save_pretrained(path, max_shard_size="100KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard_files = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shard_files) >= 3 and not os.path.exists(os.path.join(path, "model.safetensors"))
    _check_parity(load_target(path, dtype="float32"), model, _ids(1, 16, seed=10))

    broken = str(tmp_mod / "llama_sharded_broken")
    shutil.copytree(path, broken)
    os.remove(os.path.join(broken, shard_files[1]))
    with pytest.raises(FileNotFoundError, match=shard_files[1]):
        load_target(broken, dtype="float32")


def test_missing_and_unexpected_tensors_error(tmp_mod):
    cfg = llama.LlamaTargetConfig.create(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=2)
    params = llama.init_params(cfg, jax.random.key(0))
    path = str(tmp_mod / "mismatch")
    llama.save_hf_checkpoint(params, cfg, path)
    # Declare the checkpoint tied -> lm_head.weight is tolerated, but claim 4 layers -> layer 3 missing.
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["num_hidden_layers"] = 4
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match=r"missing tensors: .*model\.layers\.3\.mlp\.down_proj\.weight"):
        load_target(path, dtype="float32")
    hf["num_hidden_layers"] = 2
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match=r"unexpected tensors: .*model\.layers\.2\."):
        load_target(path, dtype="float32")


def test_unsupported_architecture_error(tmp_mod):
    path = tmp_mod / "gpt_neox"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_target(str(path))
    with pytest.raises(ValueError, match="supported"):
        get_target_class("GPT2LMHeadModel")
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)
    assert list(SUPPORTED_ARCHITECTURES) == sorted(SUPPORTED_ARCHITECTURES)


def test_config_errors_and_rope_layouts():
    hf = _llama_cfg().to_dict()
    with pytest.raises(ValueError, match="attention_bias"):
        llama.LlamaTargetConfig.from_hf({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="yarn"):
        llama.LlamaTargetConfig.from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    # Legacy (transformers 4) layout: top-level rope_theta + rope_scaling with "type".
    legacy = {"rope_theta": 5e5, "max_position_embeddings": 4096,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert rope_spec_from_hf(legacy) == rope_spec_from_hf(new) == RopeSpec("llama3", 5e5, 8.0, 1.0, 4.0, 8192)
    assert rope_spec_from_hf({"rope_theta": 123.0}) == RopeSpec("default", 123.0)
    # Transformers' own config dict round-trips through from_hf (no architectures -> model_type).
    assert llama.LlamaTargetConfig.from_hf(_qwen3_cfg().to_dict()).architecture == "Qwen3ForCausalLM"


def test_aux_layer_ids_validation(llama_untied):
    _, path = llama_untied
    target = load_target(path, dtype="float32")  # 5 layers
    ids = _ids(1, 8)
    for bad in [(3, 2, 1), (0, 0, 2), (0, 1, 5), (-1, 1, 2)]:
        with pytest.raises(ValueError, match=r"0\.\.4"):
            target(ids, aux_layer_ids=bad)
        with pytest.raises(ValueError, match=r"0\.\.4"):
            target.forward(target.params, ids, aux_layer_ids=bad)
    assert target.default_aux_layer_ids() == (1, 2, 3)
    assert len(target(ids).aux_hidden) == 3  # None -> default triple
    expected = {3: (0, 1, 2), 4: (1, 2, 3), 6: (1, 2, 3), 8: (1, 3, 4), 9: (1, 3, 5), 32: (1, 15, 28), 80: (1, 39, 76)}
    for n, want in expected.items():
        assert default_aux_layer_ids(n) == want
    for n in range(3, 100):
        a, b, c = default_aux_layer_ids(n)
        assert 0 <= a < b < c <= n - 1
    with pytest.raises(ValueError):
        default_aux_layer_ids(2)


def test_param_logical_axes_match_params(qwen3):
    _, path = qwen3
    target = load_target(path, dtype="float32")
    axes = target.param_logical_axes()
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(target.params)
    for ax, leaf in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(target.params)):
        assert len(ax) == leaf.ndim
    assert axes["layers"]["self_attn"]["q_proj"]["kernel"] == ("layers", "embed", "heads")
    assert axes["layers"]["self_attn"]["k_proj"]["kernel"] == ("layers", "embed", "kv_heads")
    assert axes["embed_tokens"]["embedding"] == ("vocab", "embed")


# ---------------------------------------------------------------------------------------------
# Export round trip and bf16
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("LlamaForCausalLM", False), ("Qwen3ForCausalLM", True)])
def test_save_hf_checkpoint_round_trip(tmp_mod, arch, tied):
    # Torch-free toy config -> random JAX params -> HF checkpoint -> transformers must agree.
    cfg = llama.LlamaTargetConfig.create(
        architecture=arch, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24 if arch.startswith("Qwen3") else None,
        tie_word_embeddings=tied, rope_theta=1000.0,
    )
    params = llama.init_params(cfg, jax.random.key(7))
    # Bigger weights than init_params' std 0.02 (and non-unit norm scales) so attention is far
    # from uniform and every tensor's name/layout matters to the comparison.
    peak_weights_(params, cfg, 0)
    path = str(tmp_mod / f"export_{arch}_{tied}")
    llama.save_hf_checkpoint(params, cfg, path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == arch
    # The functional API under the caller's jit (as a train step would use it).
    fwd = jax.jit(llama.forward, static_argnums=1, static_argnames="aux_layer_ids")
    ids = _ids(2, 16, seed=11)
    final, aux = fwd(params, cfg, jnp.asarray(ids), aux_layer_ids=(0, 1, 3))
    ref = _hf_forward(model, ids)
    errs = {"logits": rel_err(llama.logits(params, cfg, final), ref.logits.numpy())}
    errs.update({f"aux{k}": rel_err(a, _hf_aux(ref, k, 4)) for k, a in zip((0, 1, 3), aux)})
    print({k: f"{v:.2e}" for k, v in errs.items()})
    assert max(errs.values()) <= REL_TOL, errs
    # And our own loader restores exactly the same params and config.
    reloaded = load_target(path, dtype="float32")
    assert reloaded.config == cfg and reloaded.arch == arch
    jax.tree.map(np.testing.assert_array_equal, reloaded.params, params)


def test_bf16_checkpoint_load(tmp_mod, llama_untied):
    model, _ = llama_untied
    model_bf16 = transformers.AutoModelForCausalLM.from_config(model.config)
    model_bf16.load_state_dict(model.state_dict())
    model_bf16 = model_bf16.to(torch.bfloat16).eval()
    path = str(tmp_mod / "llama_bf16")
    model_bf16.save_pretrained(path)
    ids = _ids(2, 16, seed=12)

    # bf16 on disk -> fp32 params: exactly HF loading the same bf16 file into fp32.
    # (Not model_bf16.float(): .to(bfloat16) also rounds HF's rotary inv_freq buffer.)
    t32 = load_target(path, dtype="float32")
    assert t32.params["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.float32
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_parity(t32, ref_model, ids)

    # bf16 params: dtype flows through the forward; logits stay fp32 and close to the fp32 run.
    t16 = load_target(path, dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(t16.params))
    out16 = t16(ids)
    assert out16.logits.dtype == jnp.float32 and out16.final_hidden.dtype == jnp.bfloat16
    assert all(a.dtype == jnp.bfloat16 for a in out16.aux_hidden)
    np.testing.assert_array_equal(
        np.asarray(t16.params["embed_tokens"]["embedding"]).astype(np.float32),
        np.asarray(t32.params["embed_tokens"]["embedding"]),
    )
    assert rel_err(out16.logits, t32(ids).logits) <= 5e-2

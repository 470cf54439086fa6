"""Gemma 3 (``Gemma3ForCausalLM``) vs transformers (PyTorch) on tiny random checkpoints (CPU, fp32).

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state
(HF ``hidden_states[-1]``) and three aux states (aux id k = HF ``hidden_states[k+1]``). The tiny
model has what makes Gemma 3 differ from Llama: (1 + weight) RMSNorms (four per layer and the q/k
norms), GeGLU with tanh GELU, the sqrt(hidden) embedding scale, query_pre_attn_scalar != head_dim,
sliding layers (window 5, shorter than every test sequence) with their own RoPE base next to global
layers with linear-scaled RoPE, GQA and tied embeddings. Weights are redrawn far from HF's init
(parity._hf_weights.randomize_). Cached decoding equals the forward (rel 1e-5) across the window, and
the legacy config layout (rope_local_base_freq, sliding_window_pattern) reads the same.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import load_target  # noqa: E402
from specjax.targets.gemma3 import FULL, SLIDING, Gemma3TargetConfig  # noqa: E402
from specjax.targets.loading import read_hf_config  # noqa: E402
from specjax.targets.registry import get_target_class  # noqa: E402

from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
DECODE_TOL = 1e-5
VOCAB = 128
WINDOW = 5
AUX = (0, 2, 4)
TYPES = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]


def _cfg(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                layer_types=TYPES, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0,
                rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                 SLIDING: {"rope_type": "default", "rope_theta": 5000.0}})
    base.update(kw)
    return transformers.Gemma3TextConfig(**base)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(_cfg()).eval()
    model.config._attn_implementation = "eager"
    randomize_(model, seed=1)
    path = str(tmp_path_factory.mktemp("gemma3"))
    model.save_pretrained(path)
    return model, load_target(path, dtype="float32")


def _ids(t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (2, t)).astype(np.int32)


@pytest.mark.parametrize("length", [4, 19])  # inside the window; well past it
def test_forward_matches_transformers(pair, length):
    model, target = pair
    assert target.config.sliding_layers == tuple(t == SLIDING for t in TYPES)
    ids = _ids(length)
    out = target(ids, aux_layer_ids=AUX)
    with torch.no_grad():
        ref = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    errs = {"logits": rel_err(out.logits, ref.logits.numpy()),
            "final": rel_err(out.final_hidden, ref.hidden_states[-1].numpy())}
    errs.update({f"aux{k}": rel_err(a, ref.hidden_states[k + 1].numpy()) for k, a in zip(AUX, out.aux_hidden)})
    print(f"\ngemma3 T={length}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= REL_TOL, f"T={length} {k}: rel err {v:.3e} > {REL_TOL}"


def test_packed_rows_equal_separate_documents(pair):
    """Segments reset both the causal and the window mask: a packed row's second document equals it run alone."""
    _, target = pair
    a, b = _ids(9, seed=4)[0], _ids(11, seed=5)[0]
    packed = np.concatenate([a, b])[None]
    seg = np.concatenate([np.ones(9, np.int32), np.full(11, 2, np.int32)])[None]
    pos = np.concatenate([np.arange(9), np.arange(11)]).astype(np.int32)[None]
    got = target(packed, positions=pos, segment_ids=seg)
    alone = target(b[None])
    np.testing.assert_allclose(np.asarray(got.logits)[0, 9:], np.asarray(alone.logits)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pieces", [[(0, 3), (3, 4), (4, 9), (9, 10), (10, 16)], [(0, 12), (12, 13), (13, 16)]])
def test_cached_decoding_equals_forward(pair, pieces):
    _, target = pair
    t = pieces[-1][1]
    ids = jnp.asarray(_ids(t, seed=3))
    full = target(ids, aux_layer_ids=AUX)
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=AUX))
    cache = target.init_cache(2, t)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    got = []
    for a, b in pieces:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], jnp.full((2,), a, jnp.int32))
        got.append((logits, final, aux))
    errs = {"logits": rel_err(np.concatenate([g[0] for g in got], 1), full.logits),
            "final": rel_err(np.concatenate([g[1] for g in got], 1), full.final_hidden)}
    errs.update({f"aux{AUX[k]}": rel_err(np.concatenate([g[2][k] for g in got], 1), full.aux_hidden[k])
                 for k in range(len(AUX))})
    for k, v in errs.items():  # relative to the largest value (the logits reach ~12 here)
        assert v <= DECODE_TOL, f"{pieces} {k}: rel err {v:.2e} > {DECODE_TOL}"


def test_legacy_config_layout_reads_the_same():
    """Hub config.json files (transformers 4.5x) carry rope_theta / rope_local_base_freq / rope_scaling
    and sliding_window_pattern instead of per-layer-type rope_parameters and layer_types."""
    new = Gemma3TargetConfig.from_hf({**_cfg().to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    legacy = {k: v for k, v in new.to_hf().items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=100000.0, rope_local_base_freq=5000.0, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert Gemma3TargetConfig.from_hf(legacy) == new
    assert Gemma3TargetConfig.from_hf(new.to_hf()) == new
    through = transformers.Gemma3TextConfig(**{k: v for k, v in new.to_hf().items()
                                               if k not in ("architectures", "model_type")}).to_dict()
    assert Gemma3TargetConfig.from_hf({**through, "architectures": ["Gemma3ForCausalLM"]}) == new


@pytest.mark.parametrize("key,value,match", [("final_logit_softcapping", 30.0, "soft-capping"),
                                             ("attn_logit_softcapping", 50.0, "soft-capping"),
                                             ("hidden_activation", "gelu", "gelu_pytorch_tanh"),
                                             ("use_bidirectional_attention", True, "causal target")])
def test_unsupported_options_are_refused(key, value, match):
    hf = {**_cfg().to_dict(), "architectures": ["Gemma3ForCausalLM"], key: value}
    with pytest.raises(ValueError, match=match):
        Gemma3TargetConfig.from_hf(hf)


def test_real_config_counts_the_published_parameters():
    """google/gemma-3-1b-it: 999,885,952 parameters (the model page's safetensors total; tied embeddings)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hf = read_hf_config(os.path.join(repo, "configs", "targets", "gemma3_1b"))
    cls = get_target_class(hf)
    cfg = cls.config_from_hf(hf)
    assert sum(math.prod(s.shape) for s in cls.weight_specs(cfg)) == 999_885_952
    assert cfg.sliding_layers.count(False) == 4 and cfg.sliding_window == 512
    assert cfg.rope.theta == 1e6 and cfg.rope_local.theta == 1e4

"""benchmarks/train_throughput.py: both systems train against the same random target (issue 25, item 3).

Before, specjax drew its target with jax.random / numpy and SpecForge's transformers model kept its own
init: the same law (normal(0, 0.02), norms 1) but another sample, and a random Qwen3-MoE target's
hidden states collapse onto one direction, so its argmax (which decides the rows the loss counts) was
a lottery: first losses 19.3 against 6.1 at the real shape (results/train_throughput.md, "Random MoE
target"). Pinned here:
  * the shared generator gives the same values in numpy, JAX and torch (within 1e-7 absolute, fp32
    log/cos rounding) and has transformers' law (std 0.02 within 1%, mean 0, normal kurtosis);
  * transformers' own init has the same per-tensor std as specjax's leaves (0.02 within 10% at these
    tiny sizes; norms exactly 1), so the fill changes the sample, not the law;
  * after the fill, transformers' model and specjax's target are the same function: logits within
    1e-5 relative (fp32) and the same argmax, for the tiny Qwen3-MoE and Llama shapes.
"""
import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("train_throughput", os.path.join(ROOT, "benchmarks", "train_throughput.py"))
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def test_shared_generator_same_everywhere_and_normal():
    import jax.numpy as jnp

    key = tt.slice_key(7, ("moe_layers", "experts", "up_proj", "kernel"), 3)
    ref = tt.shared_normal_np(key, (300, 700))
    got_jax = np.asarray(tt.shared_normal_jax([key, key + 1], (300, 700), jnp.float32))
    assert np.abs(got_jax[0] - ref).max() <= 1e-7
    assert np.abs(got_jax[1] - ref).max() > 1e-3  # another key, other values
    torch = pytest.importorskip("torch")
    got_torch = tt.shared_normal_torch(key, (300, 700), torch.device("cpu"), chunk=1 << 16).numpy()
    assert np.abs(got_torch - ref).max() <= 1e-7
    z = ref.ravel() / tt.INIT_STD
    assert abs(z.std() - 1) < 0.01 and abs(z.mean()) < 0.01
    assert abs(np.mean(z**4) / np.mean(z**2) ** 2 - 3) < 0.05  # normal, not a sum of a few uniforms
    # distinct slices and leaves get distinct keys
    keys = {tt.slice_key(0, p, s) for p in (("a",), ("b",)) for s in range(50)}
    assert len(keys) == 100


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "llama3_8b"])
def test_both_sides_hold_the_same_target(model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import jax.numpy as jnp

    from specjax.targets.abstract import make_target

    hf = {k: v for k, v in tt.model_hf(model, True).items() if k not in ("bos_token_id", "eos_token_id")}
    conf = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.float32).eval()
    target = make_target(hf, **({"moe_implementation": "reference"} if model.startswith("qwen") else {}))
    params = tt.jax_random_params(target, jnp.float32, 0)
    # the laws agree before the fill: transformers' std per tensor kind = specjax's (norms 1 on both)
    for name, p in hf_model.named_parameters():
        w = p.detach().numpy()
        if name.endswith("norm.weight"):
            assert (w == 1).all(), name
        else:
            assert abs(w.std() / 0.02 - 1) < 0.1, (name, w.std())
    for spec in type(target).weight_specs(target.config):
        leaf = np.asarray(_get(params, spec.path))
        if spec.path[-1] == "scale":
            assert (leaf == 1).all(), spec.path
        else:
            assert abs(leaf.std() / 0.02 - 1) < 0.1, (spec.path, leaf.std())
    # after the fill: the same function
    assert tt.fill_hf_target_shared(hf_model, hf, 0) == len(dict(hf_model.named_parameters()))
    ids = tt.fixed_batch(2, 32, hf["vocab_size"], 1)["input_ids"]
    with torch.no_grad():
        want = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    final, _ = target.forward(params, jnp.asarray(ids), aux_layer_ids=())
    got = np.asarray(final @ target.lm_head_weight(params).T)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_gpt_oss_bf16_sides_hold_the_same_target():
    """gpt-oss with bf16 experts (the SpecForge side-by-side's target): after the fill, transformers'
    GptOssForCausalLM (fused gate_up_proj with gate and up columns interleaved, biases, sinks) and
    specjax's target are the same function (fp32, 1e-5 relative), so the fill interleaves specjax's
    [gate | up] halves back into the file's alternating columns."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import jax.numpy as jnp

    from specjax.targets.abstract import make_target

    hf = tt.model_hf("gpt_oss_20b_bf16", True)
    assert "quantization_config" not in hf
    conf = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    hf_model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    target = make_target(hf, moe_implementation="reference")
    params = tt.jax_random_params(target, jnp.float32, 0)
    assert tt.fill_hf_target_shared(hf_model, hf, 0) == len(dict(hf_model.named_parameters()))
    ids = tt.fixed_batch(2, 32, hf["vocab_size"], 1)["input_ids"]
    with torch.no_grad():
        want = hf_model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    final, _ = target.forward(params, jnp.asarray(ids), aux_layer_ids=())
    got = np.asarray(final @ target.lm_head_weight(params).T)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5

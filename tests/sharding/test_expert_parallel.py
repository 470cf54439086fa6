"""Expert parallelism: the tiny Qwen3-MoE target (MoE and dense layers mixed) trains the draft the
same on a mesh with expert=2 (x fsdp=2 x data=2) as on one device: loss and grad norm of 3 steps
within rtol 1e-5, updated draft params within rtol/atol 1e-5 (fp32). The stacked expert weights
[Lm, E, D, F] are really placed split along `expert` (their NamedSharding says so, and each device
holds E/2 experts)."""
import jax
import jax.numpy as jnp
import pytest

from _sharded_training import assert_same_training, packed_batch, train_3_steps
from specjax.targets.base import tree_set
from specjax.targets.qwen3_moe import Qwen3MoeTarget, Qwen3MoeTargetConfig

VOCAB = 256


def _moe_target():
    cfg = Qwen3MoeTargetConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=(1,))
    params: dict = {}
    key = jax.random.key(0)
    for i, spec in enumerate(Qwen3MoeTarget.weight_specs(cfg)):
        noise = jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)
        # weights larger than HF's init so routing is far from uniform (ties would make top-k fragile)
        tree_set(params, spec.path, 1.0 + 0.1 * noise if spec.path[-1] == "scale" else 0.3 * noise)
    return Qwen3MoeTarget(cfg, {}, params)


@pytest.fixture(scope="module")
def single():
    return train_3_steps(_moe_target(), {"data": 1}, 1, packed_batch(8, 32, VOCAB), VOCAB)


def test_expert2_equals_single_device(single):
    target = _moe_target()
    got = train_3_steps(target, {"data": 2, "fsdp": 2, "expert": 2}, 8, packed_batch(8, 32, VOCAB), VOCAB)
    assert_same_training(got, single)
    fns = got[2]
    for name in ("gate_proj", "up_proj", "down_proj"):
        sh = fns.target_shardings["moe_layers"]["experts"][name]["kernel"]
        assert sh.spec[1] == "expert", f"{name}: experts not split along `expert` ({sh.spec})"
        shape = target.params["moe_layers"]["experts"][name]["kernel"].shape  # [Lm, E, ...]
        assert sh.shard_shape(shape)[1] == shape[1] // 2
    # the batch is split over data x fsdp x expert (8 rows, one per device)
    assert fns.batch_sharding.spec[0] == ("data", "fsdp", "expert")

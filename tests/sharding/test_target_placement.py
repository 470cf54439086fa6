"""Target weights land on their shards at load time (each tensor device_put to its NamedSharding)."""
import jax
import numpy as np

from specjax import mesh as meshlib
from specjax.config import load_config
from specjax.targets import load_target
from specjax.train.setup import build_target


def test_target_loaded_straight_to_shards(tiny_target):
    cfg = load_config(None, [f"target.path={tiny_target}", "target.dtype=float32"])
    mesh = meshlib.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    target = build_target(cfg, mesh)
    q = target.params["layers"]["self_attn"]["q_proj"]["kernel"]  # [L, D, heads]: (layers, embed, heads)
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // 4, q.shape[2] // 2)
    ref = load_target(tiny_target, dtype="float32")
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), target.params, ref.params)

"""The outputs of the seven tiny targets (forward, __call__, cached decoding), saved to an .npz, and
compared between two checkouts: a refactor of the target code must leave every array bit-identical.

    PYTHONPATH=<checkout>:<checkout>/kernels:<checkout>/converters python benchmarks/target_outputs.py --out A.npz
    python benchmarks/target_outputs.py --compare A.npz B.npz

Runs against whichever specjax is first on sys.path (prints specjax.__file__). It uses only APIs that
older checkouts have too: Target classes from the registry, config_class.from_hf, weight_specs,
Target.forward / __call__ / init_cache / decode, and the class's commit_path_fn (Nemotron-H).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_platforms", "cpu")

import specjax  # noqa: E402
from specjax.targets import get_target_class  # noqa: E402
from specjax.targets.base import tree_set  # noqa: E402

V = 96
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=8,
              rms_norm_eps=1e-6, max_position_embeddings=512)

HF = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **COMMON),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=4, num_key_value_heads=2,
                  tie_word_embeddings=True, rope_theta=10000.0, **COMMON),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=4,
                      num_key_value_heads=2, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], **COMMON),
    "nemotron_h": dict(architectures=["NemotronHForCausalLM"], vocab_size=V, hidden_size=32,
                       layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16),
    "looped_llama": dict(architectures=["LoopedLlamaForCausalLM"], model_type="llama", num_hidden_layers=3,
                         num_key_value_heads=2, num_loops=2, loop_start=1, loop_end=3, **COMMON),
    "looped_qwen3": dict(architectures=["LoopedQwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=3,
                         num_key_value_heads=2, num_loops=3, loop_start=0, loop_end=2, tie_word_embeddings=True,
                         **COMMON),
    "hrm_text": dict(architectures=["HrmTextForCausalLM"], model_type="hrm_text", num_layers_per_stack=2,
                     num_hidden_layers=8, H_cycles=2, L_cycles=1, embedding_scale=2.0, **COMMON),
}


def build(name):
    hf = HF[name]
    cls = get_target_class(hf)
    overrides = {"decode_state_window": 16} if name == "nemotron_h" else {}
    cfg = cls.config_class.from_hf(hf, **overrides)
    rng = np.random.default_rng(sum(map(ord, name)))
    params: dict = {}
    for spec in cls.weight_specs(cfg):
        noise = rng.standard_normal(spec.shape).astype(np.float32)
        last = spec.path[-1]
        if last == "scale":
            value = 1.0 + 0.1 * noise
        elif last == "A_log":
            value = np.log(np.arange(1, spec.shape[-1] + 1, dtype=np.float32)) + 0.3 * noise
        elif last == "dt_bias":
            value = -2.0 + 0.3 * noise
        elif last == "D":
            value = 1.0 + 0.1 * noise
        elif spec.path[0] in ("embed_tokens", "embeddings", "lm_head", "z_L_init"):
            value = 0.5 * noise
        else:
            value = 0.15 * noise
        tree_set(params, spec.path, jnp.asarray(value, jnp.float32))
    return cls(cfg, hf, params)


def run(name, out):
    t = build(name)
    L = t.num_layers
    rs = np.random.RandomState(1)
    B, T = 2, 11
    ids = jnp.asarray(rs.randint(0, V, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.asarray([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2], jnp.int32)
    pos_seg = jnp.asarray([list(range(6)) + list(range(5)), list(range(9)) + [0, 0]], jnp.int32)
    tapsets = [(), t.default_aux_layer_ids(), (0,), (L - 1,), tuple(range(L)), (1, L - 2)]

    def save(key, tree):
        for i, leaf in enumerate(jax.tree.leaves(tree)):
            out[f"{name}/{key}/{i}"] = np.asarray(leaf)

    for j, taps in enumerate(tapsets):
        save(f"fwd{j}", t.forward(t.params, ids, aux_layer_ids=taps))
        save(f"fwdseg{j}", t.forward(t.params, ids, aux_layer_ids=taps, positions=pos_seg, segment_ids=seg))
        save(f"call{j}", tuple(t(ids, aux_layer_ids=taps)))
    save("call_default", tuple(t(ids)))
    save("call_seg", tuple(t(ids, positions=pos_seg, segment_ids=seg)))

    if not t.supports_decoding:
        return
    decode_chunk = getattr(t, "decode_chunk", None) or t.decode  # checkouts before the rename call it decode
    for j, taps in enumerate([t.default_aux_layer_ids(), (), (0, L - 1)]):
        dec = jax.jit(lambda c, i, p, s, m=None, vf=None, li=None, taps=taps: decode_chunk(
            t.params, c, i, p, s, aux_layer_ids=taps, chunk_mask=m, valid_from=vf, logits_index=li))
        cache = t.init_cache(B, 40)
        save(f"d{j}/init", cache)
        at = lambda s: jnp.full((B,), s, jnp.int32)  # noqa: E731
        o = dec(cache, ids[:, :5], pos[:, :5], at(0))  # prefill
        save(f"d{j}/prefill", o)
        cache = o[3]
        for k in range(5, 7):  # single tokens
            o = dec(cache, ids[:, k:k + 1], pos[:, k:k + 1], at(k))
            save(f"d{j}/one{k}", o)
            cache = o[3]
        o = dec(cache, ids[:, 7:10], pos[:, 7:10], at(7))  # chunk of 3
        save(f"d{j}/three", o)
        cache = o[3]
        # tree chunk: root + two children + one grandchild
        tree = np.zeros((4, 4), bool)
        for r, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
            tree[r, anc] = True
        tmask = jnp.asarray(np.broadcast_to(tree, (B, 4, 4)))
        tpos = jnp.broadcast_to(jnp.asarray([10, 11, 11, 12], jnp.int32), (B, 4))
        tids = jnp.asarray(rs.randint(0, V, (B, 4)), jnp.int32)
        o = dec(cache, tids, tpos, at(10), tmask)
        save(f"d{j}/tree", o)
        if hasattr(type(t), "commit_path_fn"):
            committed = type(t).commit_path_fn(o[3], jnp.int32(10), jnp.asarray([0, 1, 3], jnp.int32), jnp.int32(2))
            save(f"d{j}/commit", committed)
            o2 = dec(committed, tids[:, :1], jnp.full((B, 1), 13, jnp.int32), at(13))
            save(f"d{j}/after_commit", o2)
        # left-padded prefill with logits_index (fresh cache)
        cache2 = t.init_cache(B, 40)
        vf = jnp.asarray([0, 3], jnp.int32)
        li = jnp.asarray([[8], [8]], jnp.int32)
        ppos = jnp.asarray([list(range(9)), [0, 0, 0] + list(range(6))], jnp.int32)
        o = dec(cache2, ids[:, :9], ppos, at(0), None, vf, li)
        save(f"d{j}/padded", o)
        # eager (unjitted) single step too
        o = decode_chunk(t.params, o[3], ids[:, 9:10], pos[:, 9:10], at(9), aux_layer_ids=taps)
        save(f"d{j}/eager", o)


def compare(path_a, path_b) -> bool:
    """Print, per target, how many arrays are equal (shape, dtype and every bit); True if all are."""
    a, b = np.load(path_a), np.load(path_b)
    ok_all = True
    for fam in sorted({k.split("/")[0] for k in set(a.files) | set(b.files)}):
        keys = sorted(k for k in set(a.files) | set(b.files) if k.split("/")[0] == fam)
        bad = [k for k in keys if not (k in a.files and k in b.files and a[k].shape == b[k].shape
                                       and a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]))]
        ok_all &= not bad
        print(f"{fam:14s} {len(keys) - len(bad)}/{len(keys)} arrays bit-identical" + (f"  DIFF: {bad[:8]}" if bad else ""))
    return ok_all


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        raise SystemExit(0 if compare(*args.compare) else 1)
    if not args.out:
        ap.error("--out (or --compare A B) is required")
    print("specjax from", specjax.__file__)
    out: dict = {}
    for name in args.only or HF:
        run(name, out)
        print(name, "ok", sum(1 for k in out if k.startswith(name + "/")), "arrays")
    np.savez(args.out, **out)


if __name__ == "__main__":
    main()

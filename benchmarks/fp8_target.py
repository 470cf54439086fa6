"""What target.compute_dtype fp8 does to the frozen target's outputs (issue 60 item 2): the aux states
and final hidden of the same target with its projection GEMMs in FP8 (specjax/targets/fp8_compute.py)
against bf16, the teacher the head learns from (top-1 agreement and KL of the full-vocab softmax), the
weight bytes, and the target forward's time. The train step's speed with it is train_throughput.py's
``specjax:target_fp8=1`` variant.

    # one Hopper GPU (H100 / H200), the Llama-3.1-8B shape with train_throughput's random weights
    # (the same counter-based generator: normal(0, 0.02), norms 1), 2 x 4096 random tokens, with a
    # float32 reference for bf16's own error beside FP8's
    JAX_PLATFORMS=cuda PYTHONPATH=$PWD/kernels:$PWD python3 benchmarks/fp8_target.py --model llama3_8b \
        --batch 2 --seq 4096 --fp32-reference --out fp8_target_llama3_8b.json
    # a real checkpoint instead of random weights (an HF folder; Llama / Qwen3 / Mistral)
    JAX_PLATFORMS=cuda PYTHONPATH=$PWD/kernels:$PWD python3 benchmarks/fp8_target.py --target-path /models/Llama-3.1-8B-Instruct \
        --batch 2 --seq 4096 --out fp8_target_llama31_8b_real.json
    # check that XLA rewrote the FP8 dots into cuBLASLt FP8 GEMMs: the compiled forward's custom calls
    # are counted in the report ("fp8_gemm_calls"; 0 means the dots ran upcast)
    # CPU smoke run at tiny widths (tests/unit/test_fp8_target_script.py)
    PYTHONPATH=kernels:. python benchmarks/fp8_target.py --tiny

Relative error of a state: ||s_fp8 - s_ref|| / ||s_ref|| over all tokens (and the 99th percentile of
the per-token value); the reference is the bf16 target (and, with --fp32-reference, the float32 one,
for both bf16 and FP8). With random weights the states are a random network's; with --target-path, the
model's own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import train_throughput as tt  # noqa: E402


def state_errors(ref, got) -> dict:
    """rel error over everything, and the 99th percentile of the per-token rel error; on the host (the
    states are a few hundred MB; the device is full of weights when the fp32 reference runs)."""
    ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    d = np.linalg.norm(got - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    total = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    return {"rel": float(total), "rel_token_p99": float(np.percentile(d, 99))}


def head_agreement(w_vd, ref_final, got_final, rows: int = 1024) -> dict:
    """Teacher of the head: full-vocab softmax of the final hidden, top-1 agreement and mean
    KL(ref || got) per token, in row chunks (no [B*T, V] buffer beyond one chunk)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def chunk(a, b):
        la = jnp.einsum("nd,vd->nv", a, w_vd, preferred_element_type=jnp.float32)
        lb = jnp.einsum("nd,vd->nv", b, w_vd, preferred_element_type=jnp.float32)
        pa, lpa, lpb = jax.nn.softmax(la), jax.nn.log_softmax(la), jax.nn.log_softmax(lb)
        return jnp.sum(jnp.argmax(la, -1) == jnp.argmax(lb, -1)), jnp.sum(pa * (lpa - lpb))

    a = ref_final.reshape(-1, ref_final.shape[-1])
    b = got_final.reshape(-1, got_final.shape[-1]).astype(a.dtype)
    same, kl = 0, 0.0
    for i in range(0, a.shape[0], rows):
        s, k = chunk(a[i:i + rows], b[i:i + rows])
        same, kl = same + int(s), kl + float(k)
    return {"top1_agreement": same / a.shape[0], "kl_mean": kl / a.shape[0]}


def timed(f, *args, n: int = 5) -> float:
    import jax

    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def fp8_gemm_calls(compiled_text: str) -> int:
    """cuBLASLt FP8 matmuls in a compiled GPU program (XLA's custom-call target for them)."""
    return compiled_text.count("__cublas$lt$matmul$f8")


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from specjax.targets.abstract import make_target
    from specjax.targets.fp8_compute import fp8_compute_params, param_bytes

    t0 = time.perf_counter()
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    if args.target_path:
        from specjax.targets import load_target

        ref = load_target(args.target_path, dtype="bfloat16")
        hf, cls = ref.hf_config, type(ref)
        params_ref = ref.params
    else:
        hf = tt.model_hf(args.model, args.tiny)
        ref = make_target(hf)
        cls = type(ref)
        params_ref = tt.jax_random_params(ref, dtype, args.seed)
    fp8 = make_target(hf, compute_dtype="fp8")
    params_fp8 = fp8_compute_params(params_ref, cls.weight_specs(fp8.config), getattr(fp8.config, "weight_quant", None))
    jax.block_until_ready(params_fp8)
    L = ref.num_layers
    aux = tuple(args.aux) if args.aux else tt.default_aux_ids(L)
    V = int(hf["vocab_size"])
    ids = jnp.asarray(np.random.default_rng(args.seed).integers(0, V, (args.batch, args.seq)), jnp.int32)

    def forward_of(target):
        return jax.jit(lambda p, i: target.forward(p, i, aux_layer_ids=aux))

    f_ref, f_fp8 = forward_of(ref), forward_of(fp8)
    report = {"model": args.target_path or args.model, "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "batch": args.batch, "seq": args.seq, "aux_ids": list(aux),
              "setup_s": time.perf_counter() - t0,
              "target_param_bytes": {"bf16" if not args.tiny else "fp32": param_bytes(params_ref),
                                     "fp8": param_bytes(params_fp8)},
              "fp8_gemm_calls": fp8_gemm_calls(f_fp8.lower(params_fp8, ids).compile().as_text() or "")}
    final_ref, aux_ref = f_ref(params_ref, ids)
    final_fp8, aux_fp8 = f_fp8(params_fp8, ids)
    ref_name = "fp32" if args.tiny else "bf16"
    report["errors_vs_" + ref_name] = {
        **{f"aux_{k}": state_errors(r, g) for k, r, g in zip(aux, aux_ref, aux_fp8)},
        "final": state_errors(final_ref, final_fp8)}
    w_vd = ref.lm_head_weight(params_ref)
    report["head_vs_" + ref_name] = head_agreement(w_vd, final_ref, final_fp8)
    report["forward_s"] = {ref_name: timed(f_ref, params_ref, ids, n=args.repeats),
                           "fp8": timed(f_fp8, params_fp8, ids, n=args.repeats)}
    if args.fp32_reference and not args.tiny:
        if args.out:  # what is measured so far survives a failure of the float32 stage
            _write(report, args.out)
        # the float32 copy (4 bytes a weight) needs the device to itself: states and the head weight to
        # the host, the bf16 / FP8 weights freed as the float32 ones are made
        final_ref, aux_ref, final_fp8, aux_fp8 = jax.device_get((final_ref, aux_ref, final_fp8, aux_fp8))
        w_vd32 = jnp.asarray(w_vd, jnp.float32)
        del params_fp8, w_vd  # FP8-only buffers go with their last reference (the rest are params_ref's)
        converted = {}  # by id: a tied weight appears twice in the tree

        def to_fp32(a):
            if id(a) not in converted:
                converted[id(a)] = a.astype(jnp.float32)
                a.delete()
            return converted[id(a)]

        p32 = jax.tree.map(to_fp32, params_ref)
        del params_ref, converted
        # the float32 forward's attention in plain XLA, 1,024 queries at a time: on an H100 (2026-12-07) the
        # GPU flash kernel in float32 failed to launch (CUDA_ERROR_OUT_OF_MEMORY in gpuLaunchKernel: memory
        # the driver allocates outside JAX's pool, which XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 leaves small)
        ref32 = make_target(hf, attention_implementation="plain", attention_q_block=1024)
        final32, aux32 = jax.device_get(forward_of(ref32)(p32, ids))
        for name, (fin, ax) in (("bf16", (final_ref, aux_ref)), ("fp8", (final_fp8, aux_fp8))):
            report[f"errors_{name}_vs_fp32"] = {
                **{f"aux_{k}": state_errors(r, g) for k, r, g in zip(aux, aux32, ax)}, "final": state_errors(final32, fin)}
            report[f"head_{name}_vs_fp32"] = head_agreement(w_vd32, jnp.asarray(final32), jnp.asarray(fin))
    return report


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(report, indent=2) + "\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny llama3_8b shape, fp32 reference")
    ap.add_argument("--model", default="llama3_8b", help="a train_throughput.py model shape (random weights)")
    ap.add_argument("--target-path", default=None, help="an HF folder to load instead of random weights")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--aux", type=int, nargs="*", default=None, help="aux ids (default: EAGLE-3's 1, L/2-1, L-4)")
    ap.add_argument("--fp32-reference", action="store_true", help="also compare bf16 and FP8 against float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report JSON here")
    args = ap.parse_args(argv)
    if args.tiny:
        args.batch, args.seq, args.repeats = min(args.batch, 2), min(args.seq, 32), 1
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        _write(report, args.out)
    return report


if __name__ == "__main__":
    main()

"""Where the largest MoE targets' EAGLE-3 step fits: per-device memory of the compiled step on a mesh of
8 GPUs (XLA's buffer assignment from `--compile-only` over 8 stand-in CPU devices) and the step
lowered for a TPU v5p-64, for DeepSeek-V3 671B as released (FP8, 128x128 block scales) and Kimi
K2.5's text model (1.03 T; routed experts int4, compressed-tensors pack-quantized, group 32).

    python benchmarks/big_moe_memory.py [--cases deepseek_v3_fp8,kimi_k25_int4] [--layouts expert8,...]
        [--tpu] [--out results.json]

Each case writes a target folder (the shape's config.json from configs/targets plus the release's
quantization_config) and a run config, then runs `python -m specjax.launch --config X --compile-only`
in a subprocess per layout (the launcher makes the stand-in devices). Layouts (8 devices):
  expert8        parallelism.expert=8: each device holds 1/8 of the routed experts, the rest whole
  fsdp8          parallelism.fsdp=8: every weight's hidden dimension split 8 ways (the step gathers
                 the target's layers as it runs them)
  expert4_fsdp2  both
and for a TPU v5p-64 (`--tpu`): fsdp64, and expert8_fsdp8.
The CPU compile stands in for the GPU's: buffer assignment follows the same HLO, but the GPU's kernels
(grouped GEMM, attention) and its scheduler differ, so treat temporaries as an estimate; the weight,
optimizer-state and batch bytes per device are exact (they follow from the shardings). The TPU
lowering reports the sharded bytes only (XLA:TPU's memory analysis needs a TPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _results import write_results  # noqa: E402

# the releases' quantization_config (deepseek-ai/DeepSeek-V3 config.json; moonshotai/Kimi-K2.5's
# text_config: int4 routed experts, symmetric, group 32, everything else bf16)
QUANT = {
    "deepseek_v3_fp8": ("deepseek_v3", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}),
    "deepseek_v3_bf16": ("deepseek_v3", None),  # the temporaries without FP8 (see the module doc)
    "kimi_k25_int4": ("kimi_k2", {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["re:.*mlp\\.experts.*"],
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": 32, "dynamic": False},
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"]}),
}
LAYOUTS = {"expert8": {"expert": 8}, "fsdp8": {"fsdp": 8}, "expert4_fsdp2": {"expert": 4, "fsdp": 2}}
# a TPU v5p-64 slice (64 chips of 95 GiB): FSDP over all chips, or experts over 8 and FSDP over 8
TPU_LAYOUTS = {"fsdp64": {"fsdp": 64}, "expert8_fsdp8": {"expert": 8, "fsdp": 8}}
H200_GIB = 139.0  # usable HBM of one H200 as the device tool reports it (about 139 GiB)


def write_case(case: str, work: str, batch: int, seq: int, layout: dict) -> str:
    folder, quant = QUANT[case]
    with open(os.path.join(ROOT, "configs", "targets", folder, "config.json")) as f:
        hf = json.load(f)
    if quant is not None:
        hf["quantization_config"] = quant
    tdir = os.path.join(work, case)
    os.makedirs(tdir, exist_ok=True)
    with open(os.path.join(tdir, "config.json"), "w") as f:
        json.dump(hf, f)
    par = {"data": 1, "fsdp": 1, "tensor": 1, "context": 1, "expert": 1, **layout}
    run = os.path.join(work, f"{case}_{'_'.join(f'{k}{v}' for k, v in layout.items())}.yaml")
    with open(run, "w") as f:
        f.write(json.dumps({
            "run": {"name": case, "output_dir": os.path.join(work, "runs", case)},
            "target": {"path": tdir, "dtype": "bfloat16"},
            "draft": {"ttt_steps": 7, "draft_vocab_size": 32000},
            "data": {"train_files": ["/dev/null"], "seq_length": seq, "batch_size": batch},
            "parallelism": par}))
    return run


def compile_only(run_yaml: str, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "specjax.launch", "--config", run_yaml, "--compile-only", *extra]
    t0 = time.perf_counter()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if "--platform" not in extra:  # the GPUs' stand-ins: 8 CPU devices (the launcher makes a TPU's itself)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:], "seconds": took, "cmd": cmd[1:]}
    report = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    report["seconds"], report["cmd"] = took, cmd[1:]
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(QUANT))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batch", type=int, default=8, help="global rows (one 4096-token row per GPU at 8)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tpu", action="store_true", help="also lower for a TPU v5p-64 (TPU_LAYOUTS)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for case in a.cases.split(","):
            for name in a.layouts.split(","):
                r = compile_only(write_case(case, work, a.batch, a.seq, LAYOUTS[name]), [], a.timeout)
                r.update(case=case, layout=name, platform=r.get("platform", "cpu"))
                peak = r.get("peak_estimate_bytes_per_device")
                if peak:
                    r["peak_gib"] = peak / 2**30
                    r["fits_h200"] = r["peak_gib"] <= H200_GIB
                print(f"{case:16s} {name:14s} " + (f"peak {r['peak_gib']:.1f} GiB/device (target "
                      f"{r['target_param_bytes_per_device'] / 2**30:.1f}, temporaries {r['temp_size_in_bytes'] / 2**30:.1f}) "
                      f"fits an H200: {r['fits_h200']}" if peak else f"error {r.get('error')}") + f"  [{r['seconds']:.0f} s]",
                      flush=True)
                rows.append(r)
            for name, layout in (TPU_LAYOUTS.items() if a.tpu else ()):
                run = write_case(case, work, 64, a.seq, layout)
                r = compile_only(run, ["--platform", "tpu", "--tpu-chip", "v5p", "--devices", "64"], a.timeout)
                r.update(case=case, layout=f"tpu_v5p_64_{name}")
                tb = r.get("target_param_bytes_per_device")
                print(f"{case:16s} v5p-64 {name:14s} " + (f"target {tb / 2**30:.1f} GiB/chip, draft+optimizer "
                      f"{(r['draft_param_bytes_per_device'] + r['optimizer_state_bytes_per_device']) / 2**30:.2f} GiB/chip, "
                      f"mosaic calls {r.get('mosaic_calls')}" if tb else f"error {r.get('error')}") + f"  [{r['seconds']:.0f} s]",
                      flush=True)
                rows.append(r)
    return write_results({"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv,
                          "rows": rows}, a.out)


if __name__ == "__main__":
    sys.exit(main())

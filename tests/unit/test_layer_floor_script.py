"""benchmarks/layer_floor.py at tiny DeepSeek-V3 widths on CPU: both parts run in both formats (the FP8
one on block-scaled float8 kernels dequantized inside the call), the useful FLOPs are the hand count,
and each row compares the part with a GEMM of the same FLOPs."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("layer_floor", os.path.join(ROOT, "benchmarks", "layer_floor.py"))
lf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lf)


def test_tiny_layer_both_formats(tmp_path):
    with open(os.path.join(ROOT, "configs", "targets", "deepseek_v3", "config.json")) as f:
        hf = json.load(f)
    hf.update(hidden_size=256, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16,
              v_head_dim=16, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128,
              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, vocab_size=1000,
              intermediate_size=512)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(hf))
    out = tmp_path / "r.json"
    assert lf.main(["--config", str(tmp_path / "cfg"), "--seq", "128", "--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["part"]) for r in rows] == [("bf16", "mla"), ("bf16", "moe"), ("fp8", "mla"), ("fp8", "moe")]
    n, d, h = 128, 256, 4
    mla = 2 * (n * (d * 128 + 128 * h * 32 + d * (128 + 16) + 128 * h * 32 + h * 16 * d) + 128 * 129 // 2 * h * 48)
    moe = 2 * n * ((4 + 1) * 3 * d * 128 + d * 16)
    for r in rows:
        assert abs(r["tflop"] * 1e12 / {"mla": mla, "moe": moe}[r["part"]] - 1) < 1e-12
        assert r["ms"] > 0 and r["floor_ms"] > 0 and r["vs_floor"] > 0

"""--compile-only compiles the real step for a mesh from config.json alone (no weights, no data)."""
import json

from specjax.launch import main
from specjax.targets.llama import hf_config_dict


def test_compile_only_reports_memory_and_flops(tmp_path, capsys):
    tdir = tmp_path / "target"
    tdir.mkdir()
    hf = hf_config_dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
    (tdir / "config.json").write_text(json.dumps(hf))  # config only: no weights anywhere
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target:\n  path: {tdir}\n  dtype: bfloat16\ndraft:\n  draft_vocab_size: 256\n  ttt_steps: 3\n"
                   "data:\n  seq_length: 64\n  batch_size: 8\nparallelism:\n  data: 2\n  fsdp: 2\n  tensor: 2\n")
    assert main(["--config", str(cfg), "--compile-only"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["mesh"]["data"] == 2 and report["mesh"]["tensor"] == 2 and report["devices"] == 8
    assert report["flops_per_step"] > 0
    assert report["temp_size_in_bytes"] > 0 and report["peak_estimate_bytes_per_device"] > 0
    assert report["draft_params"] > 0 and report["target_params"] > 0
    assert "per device" in out

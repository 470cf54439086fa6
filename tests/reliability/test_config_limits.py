"""Hostile or broken model configs, weight files and manifests (issue 53, "Inputs that crash or
exhaust memory": head or target config).

Every case gets one line naming the file and the field, before anything is sized from it, through
the real entry points: `python -m specjax.export --validate` (exit 2), the import `draft.init_from`
and `specjax.eval --draft` use (`eagle3_import.read_head`, `spec_decode.load_draft`), the doctor, and
for targets `load_target`, the registry (`get_target_class(...).config_from_hf`) and
`read_hf_config` (specjax.targets.shapes and training read the config through it). The cases that
used to take gigabytes (10^9 layers; a 3 GiB sparse weights file) run in a subprocess under a 2 GiB
address-space limit, so a regression fails the test instead of eating the machine. The configs of
the largest published models pass the same checks.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from export._heads import make_draft, target_config
from specjax.export import main as export_main
from specjax.hf_config_checks import INT_FIELDS, ConfigFieldError, check_config_fields
from specjax_converters.eagle3_export import export_eagle3
from specjax_converters.eagle3_import import read_head

LIMIT_AS = 2 << 30  # address-space bound of the memory subprocesses
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

# (field, value as written to config.json, what the one line says about it)
BAD_FIELDS = [
    ("hidden_size", math.inf, "Infinity is not an integer"),
    ("hidden_size", None, "null is not an integer"),
    ("hidden_size", math.nan, "NaN is not an integer"),
    ("hidden_size", "abc", '"abc" is a string, not an integer'),
    ("hidden_size", 4096.0, "4096.0 is not an integer"),
    ("hidden_size", True, "true is a boolean, not an integer"),
    ("num_attention_heads", 0, "0 is outside [1, 4096]"),
    # just over the bound: in-process tests must not risk gigabytes if the check regresses (10^9 layers
    # are tested below in a subprocess under an address-space limit)
    ("num_hidden_layers", 4097, "4097 is outside [1, 4096]"),
    ("rms_norm_eps", math.nan, "NaN is not a finite number in (0, 1)"),
    ("rms_norm_eps", 0, "0 is not a finite number in (0, 1)"),
    ("rope_theta", math.inf, "Infinity is not a finite number in (0, inf)"),
    ("vocab_size", -5, "-5 is outside [1, 16777216]"),
]
IDS = [f"{f}={json.dumps(v)}" for f, v, _ in BAD_FIELDS]


def _write_config(folder, config) -> str:
    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, allow_nan=True)  # writes Infinity / NaN as the hostile file has them
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target_hf, cfg, params, vocab = make_draft(seed=0)
    return export_eagle3(params, cfg, vocab, target_hf, str(root / "good"), dtype="fp32")


def _bad_head(head, tmp_path, field, value) -> tuple[str, str]:
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config[field] = value
    return folder, _write_config(folder, config)


def _bad_target(tmp_path, field, value) -> tuple[str, str]:
    folder = tmp_path / "t"
    folder.mkdir()
    config = target_config()
    config[field] = value
    return str(folder), _write_config(str(folder), config)


# ----------------------------------------------------------------------------- head configs

@pytest.mark.parametrize("field, value, says", BAD_FIELDS, ids=IDS)
def test_validate_names_the_file_and_field(head, tmp_path, capsys, field, value, says):
    folder, cpath = _bad_head(head, tmp_path, field, value)
    assert export_main(["--validate", folder]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"error: {cpath}: {field}: {says}"), out
    assert out.err.count("\n") == 1 and "Fix: " in out.err


@pytest.mark.parametrize("field, value, says", BAD_FIELDS, ids=IDS)
def test_import_paths_name_the_file_and_field(head, tmp_path, field, value, says):
    """draft.init_from (warm_start_params -> read_head) and specjax.eval --draft (load_draft)."""
    from specjax.eval.spec_decode import load_draft

    folder, cpath = _bad_head(head, tmp_path, field, value)
    for load in (read_head, load_draft):
        with pytest.raises(ConfigFieldError) as e:
            load(folder)
        assert str(e.value).startswith(f"{cpath}: {field}: {says}")


def test_draft_init_from_names_the_file_and_field(head, tiny_target, tmp_path, capsys):
    """The training run itself (`python -m specjax.launch ... draft.init_from=HEAD`) stops with the one line."""
    from specjax.launch import main

    folder, cpath = _bad_head(head, tmp_path, "rope_theta", math.inf)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target:\n  path: {tiny_target}\n")
    rc = main(["--config", str(cfg), "target.dtype=float32", f"run.output_dir={tmp_path / 'o'}",
               "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=40", "data.seq_length=64",
               "data.batch_size=8", "data.val_fraction=0.0", "train.eval_batches=0", "draft.ttt_steps=2",
               "draft.draft_vocab_size=96", "train.steps=1", "train.progress=false", "export.at_end=false",
               f"draft.init_from={folder}"])
    assert rc == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"error: {cpath}: rope_theta: Infinity is not a finite number in (0, inf)")


def test_speculators_nested_field_is_named(head, tmp_path):
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": {"hidden_size": 64,
              "num_hidden_layers": 4097}}
    cpath = _write_config(folder, config)
    with pytest.raises(ConfigFieldError) as e:
        read_head(folder)
    assert str(e.value).startswith(f"{cpath}: transformer_layer_config.num_hidden_layers: 4097 is outside")


def _doctor_lines(tmp_path, target: str, draft=None) -> dict:
    """{check: (status, detail)} of `python -m specjax.doctor --config <yaml> [--draft DIR]` (its
    run_doctor) for a run config whose target folder is `target`."""
    from specjax.doctor import run_doctor

    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"target:\n  path: {target}\n")
    return {what: (status, detail) for status, what, detail in run_doctor(str(yaml), draft=draft).lines}


def test_doctor_draft_names_the_file_and_field(head, tmp_path):
    folder, cpath = _bad_head(head, tmp_path, "rms_norm_eps", math.nan)
    status, detail = _doctor_lines(tmp_path, str(tmp_path / "no_target"), draft=folder)["draft export contract"]
    assert status == "FAIL" and detail.startswith(f"{cpath}: rms_norm_eps: NaN is not a finite number in (0, 1)")


def test_manifest_target_config_is_checked(head, tmp_path, capsys):
    """The target rules of --validate read the manifest's copy of the target config."""
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    mpath = os.path.join(folder, "specjax_manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    manifest["target_config"]["hidden_size"] = math.inf
    with open(mpath, "w") as f:
        json.dump(manifest, f, allow_nan=True)
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err.startswith(f"error: {mpath}: target_config.hidden_size: Infinity is not an integer")


# ----------------------------------------------------------------------------- target configs

@pytest.mark.parametrize("field, value, says", BAD_FIELDS, ids=IDS)
def test_target_loaders_name_the_file_and_field(tmp_path, field, value, says):
    from specjax.targets.loading import load_target, read_hf_config
    from specjax.targets.registry import get_target_class

    folder, cpath = _bad_target(tmp_path, field, value)
    for read in (load_target, read_hf_config):
        with pytest.raises(ConfigFieldError) as e:
            read(folder)
        assert str(e.value).startswith(f"{cpath}: {field}: {says}")
    hf = target_config()
    hf[field] = value
    with pytest.raises(ConfigFieldError) as e:  # a dict from elsewhere (the registry path)
        get_target_class(hf).config_from_hf(hf)
    assert str(e.value).startswith(f"target config (LlamaTargetConfig): {field}: {says}")


def test_target_rope_parameters_theta(tmp_path):
    from specjax.targets.loading import load_target

    folder, cpath = _bad_target(tmp_path, "rope_parameters", {"rope_type": "default", "rope_theta": math.inf})
    with pytest.raises(ConfigFieldError) as e:
        load_target(folder)
    assert str(e.value).startswith(f"{cpath}: rope_parameters.rope_theta: Infinity is not a finite number")


def test_doctor_target_names_the_file_and_field(tmp_path):
    folder, cpath = _bad_target(tmp_path, "num_hidden_layers", 4097)
    status, detail = _doctor_lines(tmp_path, folder)["target config"]
    assert status == "FAIL" and detail.startswith(f"{cpath}: num_hidden_layers: 4097 is outside [1, 4096]")


# ----------------------------------------------------------------------------- real models pass

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "vocab_size": 129280, "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 163840,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "initializer_range": 0.02, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
KIMI_K2 = {**DEEPSEEK_V3, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
           "vocab_size": 163840, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
           "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32.0}}
LLAMA_405B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
    "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "sliding_window": None,
    "use_sliding_window": False, "hidden_act": "silu", "tie_word_embeddings": False, "max_window_layers": 94,
}


@pytest.mark.parametrize("config", [DEEPSEEK_V3, KIMI_K2, LLAMA_405B, QWEN3_235B],
                         ids=["deepseek-v3", "kimi-k2", "llama-3.1-405b", "qwen3-235b-a22b"])
def test_real_model_configs_pass(config, tmp_path):
    check_config_fields(config, "config.json")
    check_config_fields({"text_config": config}, "config.json")  # nested as a multimodal config holds it
    if config["architectures"][0] in ("LlamaForCausalLM", "Qwen3MoeForCausalLM"):
        from specjax.targets.loading import read_hf_config
        from specjax.targets.registry import get_target_class

        _write_config(str(tmp_path), config)
        hf = read_hf_config(str(tmp_path))
        cfg = get_target_class(hf).config_from_hf(hf)
        assert cfg.num_hidden_layers == config["num_hidden_layers"]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = sorted(n for n in os.listdir(os.path.join(REPO, "configs", "targets"))
                 if os.path.isfile(os.path.join(REPO, "configs", "targets", n, "config.json")))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_target_configs_pass(name):
    from specjax.targets.loading import read_hf_config
    from specjax.targets.registry import get_target_class

    hf = read_hf_config(os.path.join(REPO, "configs", "targets", name))
    assert get_target_class(hf).config_from_hf(hf).num_hidden_layers >= 1


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size", "num_experts"])
def test_bounds_are_inclusive(field):
    lo, hi, _ = INT_FIELDS[field]
    check_config_fields({field: hi}, "c")
    check_config_fields({field: lo}, "c")
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ConfigFieldError, match=f"^c: {field}: {bad} is outside \\[{lo}, {hi}\\]"):
            check_config_fields({field: bad}, "c")


def test_layers_times_experts_is_bounded():
    check_config_fields({"num_hidden_layers": 4096, "num_experts": 256}, "c")  # 2^20: the bound itself
    with pytest.raises(ConfigFieldError, match=r"^c: n_routed_experts: num_hidden_layers x n_routed_experts = "
                                               r"4096 x 16384 is over 1048576"):
        check_config_fields({"num_hidden_layers": 4096, "n_routed_experts": 16384}, "c")


# ----------------------------------------------------------------------------- memory-bounded subprocesses

def _bounded(code: str, *args: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose address space is capped at LIMIT_AS (a MemoryError or a
    failed mmap instead of gigabytes), with its peak resident memory printed last on stderr (VmHWM:
    this program's own peak; ru_maxrss would also count the forking test process)."""
    pre = ("import resource, sys\n"
           f"resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_AS}, {LIMIT_AS}))\n"
           "import atexit\n"
           "def peak():\n"
           "    hwm = [ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')]\n"
           "    print('maxrss_kib', hwm[0] if hwm else 0, file=sys.stderr)\n"
           "atexit.register(peak)\n")
    return subprocess.run([sys.executable, "-c", pre + code, *args], capture_output=True, text=True, timeout=180,
                          env=ENV)


VALIDATE = "from specjax.export import main\nsys.exit(main(['--validate', sys.argv[1]]))\n"


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("maxrss_kib")]
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_billion_layer_head_in_bounded_memory(head, tmp_path):
    folder, cpath = _bad_head(head, tmp_path, "num_hidden_layers", 10 ** 9)
    r = _bounded(VALIDATE, folder)
    assert _one_error_line(r).startswith(f"error: {cpath}: num_hidden_layers: 1000000000 is outside [1, 4096]")


def test_billion_layer_target_in_bounded_memory(head, tmp_path):
    """load_target on a folder with weights: before the check, the weight map of 10^9 layers was
    built (gigabytes) before any file was read."""
    folder, cpath = _bad_target(tmp_path, "num_hidden_layers", 10 ** 9)
    shutil.copy(os.path.join(head, "model.safetensors"), folder)  # any valid weights file
    code = ("from specjax.targets.loading import load_target\n"
            "try:\n    load_target(sys.argv[1])\n"
            "except ValueError as e:\n    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n")
    r = _bounded(code, folder)
    assert _one_error_line(r).startswith(f"error: {cpath}: num_hidden_layers: 1000000000 is outside [1, 4096]")


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _write_weights(path, header: dict, data: bytes, size: int | None = None) -> None:
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
    if size is not None:
        os.truncate(path, size)  # sparse: costs no disk


GIB3 = 3 << 30


def _sparse_head(head, tmp_path, kind: str) -> str:
    """A copy of the head (no manifest) whose model.safetensors is a 3 GiB sparse file of one of three
    kinds: `header` (the header length claims nearly all of it), `tensor` (a consistent header whose
    fc.weight declares 3 GiB), `trailing` (3 GiB of bytes after the tensors the header describes)."""
    folder = str(tmp_path / kind)
    shutil.copytree(head, folder)
    os.remove(os.path.join(folder, "specjax_manifest.json"))
    path = os.path.join(folder, "model.safetensors")
    header, start = _header(path)
    raw = open(path, "rb").read()
    if kind == "header":
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", GIB3 - 8))
        os.truncate(path, GIB3)
    elif kind == "trailing":
        os.truncate(path, GIB3)
    else:
        header.pop("__metadata__", None)
        kept, data, off = {}, b"", 0
        for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if k == "fc.weight":
                continue
            b, e = v["data_offsets"]
            kept[k] = {**v, "data_offsets": [off, off + e - b]}
            data += raw[start + b:start + e]
            off += e - b
        rows = GIB3 // (4 * 4096)
        kept["fc.weight"] = {"dtype": "F32", "shape": [rows, 4096], "data_offsets": [off, off + rows * 4096 * 4]}
        blob = json.dumps(kept).encode()
        blob += b" " * (-len(blob) % 8)
        _write_weights(path, kept, data, 8 + len(blob) + off + rows * 4096 * 4)
    assert os.path.getsize(path) >= GIB3 - 8 and os.stat(path).st_blocks * 512 < (16 << 20)
    return folder


@pytest.mark.parametrize("kind, says", [
    ("header", "the header length says 3221225464 bytes, more than the 100000000 safetensors allows"),
    ("trailing", "bytes follow the last tensor"),
])
def test_sparse_3gib_weights_refused_in_bounded_memory(head, tmp_path, kind, says):
    folder = _sparse_head(head, tmp_path, kind)
    r = _bounded(VALIDATE, folder)
    line = _one_error_line(r)
    assert line.startswith(f"error: {folder}/model.safetensors is truncated or not a safetensors file: ")
    assert says in line


def test_sparse_3gib_tensor_never_read(head, tmp_path):
    """A consistent header declaring a 3 GiB fc.weight: validate reports the shape (the file and the
    tensor named) without reading the data; the import refuses it the same way."""
    folder = _sparse_head(head, tmp_path, "tensor")
    r = _bounded(VALIDATE, folder)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errs = [ln for ln in r.stdout.splitlines() if ln.startswith("  error:")]
    assert errs == [f"  error: fc.weight: shape ({GIB3 // (4 * 4096)}, 4096) but config.json implies (64, 192). "
                    "Fix: export the config the weights were trained with (hidden_size, heads, head_dim, "
                    "intermediate_size, draft_vocab_size, target_hidden_size, aux count) [shapes]"], r.stdout
    assert int(r.stderr.split("maxrss_kib ")[1]) < 512 << 10, r.stderr  # KiB: never near the 3 GiB
    code = ("from specjax_converters.eagle3_import import read_head\n"
            "try:\n    read_head(sys.argv[1])\n"
            "except ValueError as e:\n    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n")
    assert _one_error_line(_bounded(code, folder)).startswith(
        f"error: cannot import {folder}: fc.weight: shape ({GIB3 // (4 * 4096)}, 4096) but the config implies")


def test_target_tensor_of_wrong_size_is_not_read(head, tmp_path):
    """load_target compares a tensor's shape in the header before reading it: a 3 GiB sparse
    embedding with the wrong shape fails by name in bounded memory."""
    from specjax.targets import llama as tl

    folder = tmp_path / "t"
    folder.mkdir()
    hf = target_config()
    _write_config(str(folder), hf)
    cfg = tl.LlamaTargetConfig.from_hf(hf)
    specs = tl.weight_specs(cfg)
    header, data, off = {}, b"", 0
    for spec in specs:
        for _, name in spec.hf_tensors(cfg.num_hidden_layers):
            shape = list(spec.hf_file_shape)
            if name == "model.embed_tokens.weight":
                shape = [GIB3 // (4 * shape[1]), shape[1]]
            n = int(np.prod(shape)) * 4
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
            off += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    _write_weights(str(folder / "model.safetensors"), header, b"", 8 + len(blob) + off)
    code = ("from specjax.targets.loading import load_target\n"
            "try:\n    load_target(sys.argv[1], dtype='float32')\n"
            "except ValueError as e:\n    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n")
    line = _one_error_line(_bounded(code, str(folder)))
    assert line == (f"error: tensor model.embed_tokens.weight has shape ({GIB3 // (4 * 64)}, 64), expected (300, 64)")


# ----------------------------------------------------------------------------- safetensors headers

def _shift_last_back(header):
    """The last tensor moved 4 bytes back onto the one before it (its length unchanged)."""
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    b, e = header[last]["data_offsets"]
    header[last]["data_offsets"] = [b - 4, e - 4]


@pytest.mark.parametrize("edit, says", [
    (lambda h: h["fc.weight"].update(shape=5), "tensor 'fc.weight' has shape 5, not a list of sizes"),
    (lambda h: h["fc.weight"].update(shape=[64, "192"]), "tensor 'fc.weight' has shape [64, '192']"),
    (lambda h: h["fc.weight"].update(dtype="F33"), "tensor 'fc.weight' has dtype 'F33', not a safetensors dtype"),
    (lambda h: h["fc.weight"].update(shape=[64, 191]), "tensor 'fc.weight' (F32 [64, 191]) needs 48896 bytes, "
                                                        "but its data_offsets span 49152"),
    (_shift_last_back, "overlaps the tensor before it"),
], ids=["shape-5", "shape-str", "dtype", "size", "overlap"])
def test_bad_safetensors_header_is_one_line(head, tmp_path, capsys, edit, says):
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    path = os.path.join(folder, "model.safetensors")
    header, start = _header(path)
    data = open(path, "rb").read()[start:]
    edit(header)
    _write_weights(path, header, data)
    assert export_main(["--validate", folder]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} is truncated or not a safetensors file: ") and says in err, err
    assert err.count("\n") == 1


# ----------------------------------------------------------------------------- the manifest

def _manifest_head(head, tmp_path, edit) -> tuple[str, str]:
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    mpath = os.path.join(folder, "specjax_manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    with open(mpath, "w") as f:
        json.dump(edit(manifest), f)
    return folder, mpath


@pytest.mark.parametrize("edit, says", [
    (lambda m: [m], "(file): a JSON list, not an object of specjax manifest fields"),
    (lambda m: {**m, "files": []}, "files: a JSON list, not an object of file name -> {sha256, bytes}"),
    (lambda m: {**m, "files": {"/dev/zero": {"sha256": "0"}}}, 'files: "/dev/zero" is not a file inside'),
    (lambda m: {**m, "files": {"": {"sha256": "0"}}}, 'files: "" is not a file inside'),
])
def test_malformed_manifest_is_one_line(head, tmp_path, capsys, edit, says):
    folder, mpath = _manifest_head(head, tmp_path, edit)
    assert export_main(["--validate", folder]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {mpath}: {says}") and err.count("\n") == 1, err


AUDIT_OPENS = """
import json
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)):
        opened.append(args[0] if isinstance(args[0], str) else args[0].decode())
sys.addaudithook(hook)
from specjax.export import main
rc = main(['--validate', sys.argv[1]])
with open(sys.argv[2], 'w') as f:
    json.dump(opened, f)
sys.exit(rc)
"""


def test_manifest_entry_outside_the_folder_is_never_opened(head, tmp_path):
    """`../secret` and an absolute path in the manifest: refused by name, and the process never opens
    them (Python's audit hook records every open of the validating process)."""
    secret = tmp_path / "secret"
    secret.write_text("not the head's")
    for name in ("../secret", str(secret)):
        folder, mpath = _manifest_head(head, tmp_path / name.replace("/", "_"),
                                       lambda m: {**m, "files": {**m["files"], name: {"sha256": "0" * 64}}})
        log = tmp_path / "opened.json"
        r = subprocess.run([sys.executable, "-c", "import sys\n" + AUDIT_OPENS, folder, str(log)],
                           capture_output=True, text=True, timeout=120, env=ENV)
        says = f"error: {mpath}: files: {json.dumps(name)} is not a file inside"
        assert r.returncode == 2 and r.stderr.startswith(says), r.stderr
        opened = [os.path.realpath(p) for p in json.loads(log.read_text())]
        assert str(secret) not in opened and os.path.realpath(mpath) in opened


def test_manifest_entry_that_is_a_fifo_does_not_block(head, tmp_path, capsys):
    """A listed name inside the folder that is a FIFO (it would block a reader forever) is reported
    as not a regular file, never opened."""
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    os.mkfifo(os.path.join(folder, "pipe"))
    folder, mpath = _manifest_head(head, tmp_path / "x",
                                   lambda m: {**m, "files": {**m["files"], "pipe": {"sha256": "0" * 64}}})
    os.mkfifo(os.path.join(folder, "pipe"))
    assert export_main(["--validate", folder]) == 1
    out = capsys.readouterr().out
    assert "  error: pipe: listed in specjax_manifest.json but missing (or not a regular file)" in out


def test_index_shard_outside_the_folder_is_refused(head, tmp_path, capsys):
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "model-1.safetensors"))
    header, _ = _header(os.path.join(folder, "model-1.safetensors"))
    weight_map = {k: "model-1.safetensors" for k in header if k != "__metadata__"}
    weight_map["fc.weight"] = "../../etc/passwd"
    ipath = os.path.join(folder, "model.safetensors.index.json")
    with open(ipath, "w") as f:
        json.dump({"weight_map": weight_map}, f)
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err.startswith(f'error: {ipath}: weight_map: "../../etc/passwd" is not a file inside')


def test_target_index_shard_outside_the_folder_is_refused(tmp_path):
    from specjax.targets.loading import load_target

    folder, _ = _bad_target(tmp_path, "vocab_size", 300)  # a good config
    ipath = os.path.join(folder, "model.safetensors.index.json")
    with open(ipath, "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": "/dev/zero"}}, f)
    with pytest.raises(ValueError) as e:
        load_target(folder)
    assert str(e.value).startswith(f'{ipath}: weight_map: "/dev/zero" is not a file inside {folder}')


def test_config_that_is_not_an_object_or_too_deep(head, tmp_path, capsys):
    folder = str(tmp_path / "h")
    shutil.copytree(head, folder)
    cpath = os.path.join(folder, "config.json")
    for text, says in (("[1, 2]", "(file): a JSON list, not an object of model config fields"),
                       ("[" * 100000 + "]" * 100000, "(file): JSON nested too deep to read")):
        open(cpath, "w").write(text)
        assert export_main(["--validate", folder]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {cpath}: {says}") and err.count("\n") == 1, err


def test_check_uses_no_jax():
    """The checks live where the jax-free head readers may import them."""
    r = subprocess.run([sys.executable, "-c", "import sys, specjax.hf_config_checks, specjax_converters.head_files; "
                        "print(any(m == 'jax' or m.startswith('jax.') for m in sys.modules))"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.stdout.strip() == "False", r.stderr


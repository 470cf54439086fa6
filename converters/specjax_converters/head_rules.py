"""Validation rules shared by every head format (EAGLE-3 and DFlash), and the record a head format
gives the folder dispatch (`HeadFormat`, listed in specjax_converters.head_formats).

- `errors`, `ExportValidationError`: the error findings, and the exception an export raises on them;
- `same_value`: config values compared as engines read them (numbers with a tolerance, nested);
- `check_weight_dtypes`: one float dtype, the declared one, no NaN/Inf;
- `check_vocab_maps`: d2t / t2d dtypes, shapes, ids in range and ascending, the two maps agreeing;
- `check_embedding_copy`: a shipped embed_tokens of the right shape (a warning) or the wrong one.

Each rule reports through `bad(rule, field, problem, fix, level="error")`. No jax at import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from specjax.drafts import weights
from specjax_converters.head_files import NP_TO_ST, ST_TO_NP, Finding, HeadTensors

__all__ = ["EMBED_KEY", "FLOAT_DTYPES", "VOCAB_DTYPES", "ExportValidationError", "HeadFormat", "check_embedding_copy",
           "check_vocab_maps", "check_weight_dtypes", "errors", "same_value"]

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# d2t / t2d are stored the same way in every head format: I64 offsets and a BOOL mask
VOCAB_DTYPES = {name: NP_TO_ST[dtype] for name, dtype in weights.EAGLE3_VOCAB_TENSORS.items()}
EMBED_KEY = "embed_tokens.weight"


class ExportValidationError(ValueError):
    """Raised when a head fails validation; `findings` holds every error (and the warnings)."""

    def __init__(self, findings: Sequence[Finding], what: str = "EAGLE-3 export"):
        self.findings = list(findings)
        # one line per error, each "<what>: <field>: <problem>. Fix: <fix> [<rule>]"
        super().__init__("\n".join(f"{what}: {f.field}: {f.problem}. Fix: {f.fix} [{f.rule}]"
                                   for f in errors(self.findings)))


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def same_value(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


@dataclass(frozen=True)
class HeadFormat:
    """One head format for the folder dispatch (specjax_converters.head_formats.validate_folder):
    `recognises(config)` says whether a config.json is this format's, `layout(config)` names the
    layout in the validation report, `check(config, tensors, *, target_config, training_ids, manifest,
    check_finite)` runs the format's rules, and `refusal(folder, config)` (checked for every folder)
    is the error for a folder no format can read, else None."""
    name: str
    recognises: Callable[[Mapping], bool]
    layout: Callable[[Mapping], str]
    check: Callable[..., list]
    refusal: Callable[[str, Mapping], Optional[str]] = lambda folder, config: None


def check_weight_dtypes(cfg: Mapping, tensors: HeadTensors, weight_keys, bad, check_finite: bool,
                        shapes: Optional[Mapping[str, tuple]] = None) -> None:
    """The stored weights (`weight_keys`): one float dtype, the one config.json declares, and (with
    `check_finite`) no NaN/Inf, read a block at a time, in the weights whose stored shape is the one
    in `shapes` (a wrong shape is already an error; its data is not read)."""
    dtypes = sorted({tensors.dtype(k) for k in weight_keys})
    non_float = [d for d in dtypes if d not in FLOAT_DTYPES]
    if non_float:
        bad("dtype.weights", "model.safetensors", f"weights stored as {non_float}", "store weights as bf16 or fp32")
    elif len(dtypes) > 1:
        bad("dtype.weights", "model.safetensors", f"mixed weight dtypes {dtypes}", "store all weights in one dtype",
            "warning")
    declared = cfg.get("torch_dtype") or cfg.get("dtype")
    if declared and len(dtypes) == 1 and ST_TO_NP.get(dtypes[0]) != declared:
        bad("dtype.weights", "torch_dtype", f"config says {declared!r}, weights are {ST_TO_NP.get(dtypes[0])}",
            "write torch_dtype equal to the stored dtype", "warning")
    if check_finite and not non_float:
        for k in weight_keys:
            if shapes is not None and tuple(tensors.shape(k)) != tuple(shapes[k]):
                continue
            if not tensors.all_finite(k):  # a block at a time: memory stays bounded for any size
                bad("weights.finite", k, "contains NaN or Inf", "export a checkpoint from before the divergence")


def check_embedding_copy(cfg: Mapping, tensors: HeadTensors, bad, *, shape_fix: str, copy_problem: str,
                         copy_fix: str) -> None:
    """A shipped embed_tokens.weight: an error when its shape is not [vocab_size, hidden_size], else a
    warning (`copy_problem` / `copy_fix` say what the engines do with it)."""
    if EMBED_KEY not in tensors:
        return
    want = (int(cfg["vocab_size"]), int(cfg["hidden_size"]))
    if tuple(tensors.shape(EMBED_KEY)) != want:
        bad("shapes", EMBED_KEY, f"shape {tensors.shape(EMBED_KEY)} != {want}", shape_fix)
    else:
        bad("keys.embed_tokens", EMBED_KEY, copy_problem, copy_fix, "warning")


def check_vocab_maps(cfg, tensors: HeadTensors, bad):
    """d2t / t2d of a head whose config (`cfg`) gives vocab_size and draft_vocab_size: present only for
    a reduced draft vocab, stored as I64 [Vd] / BOOL [V], target ids in range and ascending, and t2d
    naming the same tokens as d2t."""
    V = int(cfg["vocab_size"])
    Vd = int(cfg.get("draft_vocab_size") or V)
    if Vd == V:
        if "d2t" in tensors:
            bad("vocab.d2t_unexpected", "d2t", "present in a full-vocab head: vLLM creates draft_id_to_target_id only "
                "for draft_vocab_size < vocab_size and refuses to load this head", "drop d2t from a full-vocab head")
        return
    if "d2t" not in tensors:
        bad("vocab.d2t_missing", "d2t", "absent: vLLM then maps draft id i to target id i (silently wrong tokens "
            "when draft_vocab_size < vocab_size); old SGLang crashes", "ship d2t (int64 offsets, [draft_vocab_size])")
        return
    if tensors.dtype("d2t") != VOCAB_DTYPES["d2t"] or tuple(tensors.shape("d2t")) != (Vd,):
        bad("vocab.d2t_dtype", "d2t", f"dtype {tensors.dtype('d2t')} shape {tensors.shape('d2t')}, expected "
            f"{VOCAB_DTYPES['d2t']} ({Vd},)",
            "save d2t as int64 offsets with one entry per draft token (target_id = i + d2t[i])")
        return
    d2t = tensors.array("d2t").astype(np.int64)
    ids = np.arange(Vd, dtype=np.int64) + d2t
    if ids.min() < 0 or ids.max() >= V:
        bad("vocab.ids", "d2t", f"maps draft ids to target ids outside [0, {V}) (range {ids.min()}..{ids.max()})",
            "rebuild the draft vocab for this target's vocab_size")
    elif np.any(np.diff(ids) <= 0):
        n_dup = int(ids.size - np.unique(ids).size)
        bad("vocab.ids", "d2t", f"target ids are not unique and ascending ({n_dup} duplicate(s))",
            "rebuild d2t from the sorted unique draft ids: d2t[i] = ids[i] - i")
    if "t2d" not in tensors:
        bad("vocab.t2d_missing", "t2d", "absent (engines ignore it, training tools read it)",
            "ship t2d (bool [vocab_size])", "warning")
        return
    if tensors.dtype("t2d") != VOCAB_DTYPES["t2d"] or tuple(tensors.shape("t2d")) != (V,):
        bad("vocab.t2d_dtype", "t2d", f"dtype {tensors.dtype('t2d')} shape {tensors.shape('t2d')}, expected "
            f"{VOCAB_DTYPES['t2d']} ({V},) (the target's config vocab_size)", "save t2d as a bool mask over the target vocab")
        return
    t2d = tensors.array("t2d")
    if not np.array_equal(np.flatnonzero(t2d), ids):
        bad("vocab.invariant", "t2d", "nonzero(t2d) != arange(draft_vocab_size) + d2t (the two maps name "
            "different tokens)", "build both from the same sorted draft ids")

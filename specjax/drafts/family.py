"""The draft-family protocol (`DraftFamily`) and the registry of families.

A draft family is one speculative-decoding method: EAGLE-3 / EAGLE-3.1, P-EAGLE, DFlash. Its object
supplies everything the rest of specjax needs to know about it: its `draft` config section (the keys
of its draft.type), the train.* keys it reads, the draft config built from a run's config and target,
parameter init and warm start, logical axes, the run_meta.json form of its draft config, its
training objective and loss, and its head format (export, reading a head folder back, the vLLM /
SGLang serve settings). Set-up, the train step, checkpoint export and serve_cmd call these methods;
none of them asks which family it holds.

Families register themselves with `register` (their modules are imported by
`specjax.drafts.families`, which callers import to get the built-in ones). Lookups: by the
`draft.type` value (`family_for_type`), by a draft config object (`family_of`), by the run_meta.json
`draft_family` name (`family_from_meta`; absent = "eagle3", the name runs written before DFlash
existed lack) and by a head folder's config.json (`family_for_head`). An unknown name is a
ValueError listing the known ones.

This module imports no family code and no jax.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

from specjax.config_fields import ConfigError, DraftSection
from specjax.drafts.teacher import TOPK_STATE_KEYS, TopKTeacher
from specjax.hf_config_checks import read_config_json

META_KEY = "draft_family"  # run_meta.json key beside draft_config
DEFAULT_META_NAME = "eagle3"  # the family of a run_meta.json without META_KEY


def cached_state_keys(teacher_top_k: int = 0) -> tuple[str, ...]:
    """The keys under which a batch read from an offline state cache (target.source: cache;
    specjax.data.state_cache) carries the target's states, so the step runs without the target forward:
    the final hidden state, or with precompute.teacher_top_k > 0 the top-k teacher, beside the taps."""
    return (*TOPK_STATE_KEYS, "aux_hidden") if teacher_top_k else ("final_hidden", "aux_hidden")


def target_states(target, target_params, batch: Mapping, aux_layer_ids) -> tuple[Any, tuple]:
    """(final_hidden [B, T, D], aux tuple of [B, T, D] in aux_layer_ids order) for a training batch:
    the frozen target's forward, or the cached states the batch carries (aux_hidden [B, T, A, D]; in place
    of final_hidden a TopKTeacher, which the losses' teachers take as they take the final hidden)."""
    if "aux_hidden" in batch:
        aux = batch["aux_hidden"]
        final = TopKTeacher.from_batch(batch) if "teacher_ids" in batch else batch["final_hidden"]
        return final, tuple(aux[:, :, i] for i in range(aux.shape[2]))
    return target.forward(target_params, batch["input_ids"], aux_layer_ids=tuple(aux_layer_ids),
                          positions=batch["positions"], segment_ids=batch["segment_ids"])


@dataclass(frozen=True)
class ServePlan:
    """What serve_cmd prints for one head, besides the engine commands themselves: the header
    lines, per-engine notes (a note starting "UNSUPPORTED" comments the command out), engines whose
    command is not printed (engine -> the reason line), the draft tokens per step, SGLang's extra
    flags, or an `error` (then nothing else is printed and the exit code is 2)."""
    header: tuple[str, ...] = ()
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    not_printed: Mapping[str, str] = field(default_factory=dict)
    num_spec_tokens: int = 0
    sglang_extra: tuple[str, ...] = ()
    error: Optional[str] = None


def check_one_layer_on_final_hidden(cfg, head: str) -> None:
    """The config checks of a one-layer head that reads the target's final hidden state and no taps
    (EAGLE-1, MTP): ConfigError naming `head` and the fix."""
    if cfg.draft.num_layers != 1:
        raise ConfigError(f"`draft.num_layers` = {cfg.draft.num_layers}: {head} has one decoder layer. Fix: set "
                          "draft.num_layers=1.")
    if cfg.target.aux_layer_ids:
        raise ConfigError(f"`target.aux_layer_ids` = {list(cfg.target.aux_layer_ids)}: {head} reads the target's "
                          "final hidden state, no intermediate taps. Fix: remove target.aux_layer_ids.")
    if cfg.target.source == "cache" and cfg.precompute.teacher_top_k:
        raise ConfigError(f"`precompute.teacher_top_k` > 0 with target.source=cache: {head} reads the target's final "
                          "hidden state, which a top-k cache does not hold. Fix: build the cache with "
                          "precompute.teacher_top_k=0.")


class DraftFamily:
    """One draft method. Subclass it, set the class attributes, implement the methods, and
    `register` an instance; nothing else in specjax needs an edit.

    Class attributes:
      draft_type     the `draft.type` value that selects the family
      display_name   how messages name it ("EAGLE-3")
      head_name      how messages name its exported head ("EAGLE-3 head")
      export_name    how the export's log line names the draft ("EAGLE-3": P-EAGLE exports an EAGLE-3 head)
      meta_name      run_meta.json's `draft_family` (DEFAULT_META_NAME is written as absent); families
                     sharing a config class share it (their draft configs read back the same way)
      section_class  the DraftSection subclass with the family's own draft.* keys
      config_class   the draft config class its model code takes
      draft_module   the module with its model code; the defaults of param_logical_axes /
                     config_to_dict / config_from_dict call its functions of those names
      train_keys     the train.* keys its objective reads (a changed train key of another family is
                     refused when the config loads)
      objective_note where its objective is set, said when another family's train key is refused
    """
    draft_type: ClassVar[str] = ""
    display_name: ClassVar[str] = ""
    head_name: ClassVar[str] = ""
    export_name: ClassVar[str] = ""
    meta_name: ClassVar[str] = ""
    section_class: ClassVar[type] = DraftSection
    config_class: ClassVar[type] = object
    draft_module: ClassVar[Any] = None
    train_keys: ClassVar[tuple[str, ...]] = ()
    objective_note: ClassVar[str] = ""

    # -- the config ----------------------------------------------------------------------------
    def check_config(self, cfg) -> None:
        """Cross-checks between the draft section and other sections of a loaded Config (raise
        ConfigError naming the keys and the fix). Default: none."""

    # -- the draft config ----------------------------------------------------------------------
    def default_aux_layer_ids(self, cfg, target) -> tuple[int, ...]:
        """The target layers (output-of-layer-k) the draft reads when target.aux_layer_ids is unset."""
        raise NotImplementedError

    def make_draft_config(self, cfg, target, aux_ids):
        """The draft config (a `config_class` instance) of the run's `draft` section on `target`,
        tapping `aux_ids`."""
        raise NotImplementedError

    def owns(self, draft_cfg) -> bool:
        """Whether `draft_cfg` is a draft config of this family (`family_of` asks every family)."""
        return isinstance(draft_cfg, self.config_class)

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        """Random params of `draft_cfg` (`lm_head_rows`: the target's lm_head rows of the draft
        vocab, for families whose head starts from them)."""
        raise NotImplementedError

    def initial_params(self, cfg, draft_cfg, target, vocab) -> dict:
        """The run's initial params: random from run.seed, then draft.init_from's head when set
        (`vocab`: the run's DraftVocab, None when not built yet). A family whose warm start must
        refuse another family's head says so here."""
        import jax

        if cfg.draft.init_from:
            self.check_init_from(cfg.draft.init_from)
        from_target = {"lm_head_rows": self.initial_lm_head_rows(target, vocab)}
        embedding = self.initial_embedding(target, draft_cfg)
        if embedding is not None:
            from_target["embedding"] = embedding
        params = self.init_params(draft_cfg, jax.random.key(cfg.run.seed), std=cfg.draft.init_std, **from_target)
        if cfg.draft.init_from:
            params = self.warm_start(cfg.draft.init_from, draft_cfg, vocab, params)
        return params

    def initial_lm_head_rows(self, target, vocab):
        """What init_params' `lm_head_rows` gets in a run (None: a random lm_head)."""
        return None

    def initial_embedding(self, target, draft_cfg):
        """What init_params' `embedding` gets in a run (None: the family's init_params takes no
        `embedding`, or the target's params are abstract)."""
        return None

    def check_init_from(self, folder: str) -> None:
        """Refuse draft.init_from before anything is built when `folder` is not a head this family
        can start from (say which draft.type reads it). Default: the warm start decides."""

    def warm_start(self, folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
        """`init_params` replaced by the head at `folder` (draft.init_from)."""
        raise ValueError(f"draft.init_from={folder}: draft.type={self.draft_type} ({self.display_name}) has no warm "
                         "start. Fix: remove draft.init_from")

    def param_logical_axes(self, draft_cfg) -> dict:
        """Logical sharding axes of every param leaf (specjax.mesh rules)."""
        return self.draft_module.param_logical_axes(draft_cfg)

    def config_to_dict(self, draft_cfg) -> dict:
        """The draft config as JSON-ready data (run_meta.json's draft_config)."""
        return self.draft_module.config_to_dict(draft_cfg)

    def config_from_dict(self, d: Mapping):
        return self.draft_module.config_from_dict(dict(d))

    def run_meta(self, draft_cfg) -> dict:
        """The run_meta.json entries of the draft: its config, and `draft_family` unless it is the
        default family (so the file is what runs before DFlash wrote)."""
        out = {"draft_config": self.config_to_dict(draft_cfg)}
        if self.meta_name != DEFAULT_META_NAME:
            out[META_KEY] = self.meta_name
        return out

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg):
        """What the loss reads besides the draft config (kernels, objective settings, seeds)."""
        raise NotImplementedError

    def loss_fn(self, target, draft_cfg, objective, compute_dtype) -> Callable:
        """`loss_fn(draft_params, target_params, vocab, batch, step=None) -> (loss, metrics)`."""
        raise NotImplementedError

    def frozen_leaves_kept(self, draft_cfg, updates):
        """The optimizer's `updates` with the leaves the family never trains zeroed. Default: all trained."""
        return updates

    # -- speculative decoding (specjax.eval.spec_decode / spec_loop) ----------------------------
    def decode_taps(self, draft_cfg) -> tuple[int, ...]:
        """The target layers (output-of-layer-k) whose states the draft reads while decoding."""
        raise NotImplementedError

    def reads_final_hidden(self, draft_cfg) -> bool:
        """Whether the draft reads the target's final hidden state (after the final norm, the lm_head's
        input) while decoding: the decoder then hands the proposers that state after the decode_taps
        ones in `pend_aux`. Default: no."""
        return False

    def decoding_params(self, draft_cfg, draft_params, target):
        """The params the proposers receive for decoding beside `target` (a draft that uses target
        weights besides the embedding adds them here). Default: the draft's own."""
        return draft_params

    def target_hidden_size(self, draft_cfg) -> int:
        """The width of the target states the draft reads (must equal the target's hidden_size)."""
        return draft_cfg.hidden_size

    def check_decoding(self, draft_cfg, *, mode: str, num_spec_tokens: int) -> None:
        """Refuse a decoding mode ("chain", "tree") or a draft length the head cannot draft
        (ValueError naming the fix). Default: chain only."""
        if mode != "chain":
            raise ValueError(f"a {self.head_name} drafts one chain per step; use mode='chain'")

    def resolve_draft_dtype(self, draft_dtype: str, target_dtype) -> str:
        """The dtype the draft computes in while decoding beside a target of `target_dtype`
        (`draft_dtype` "auto", "float32" or "bfloat16"). Default: float32 for "auto"."""
        return "float32" if draft_dtype == "auto" else draft_dtype

    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        """The draft's cache for one row of `max_len` slots (static size, a jnp pytree)."""
        raise NotImplementedError

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        """K = `k` draft tokens of one step from the pending rows (tokens `pend_tok`, target states
        `pend_aux` written from slot `start`, `pend_count` of them valid) and the newest token
        `last_tok`: (drafts [k] target ids, q [k, Vd] draft probabilities when `sample`, new cache)."""
        raise NotImplementedError

    def propose_tree(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, *, dcfg,
                     widths: tuple[int, ...], top_k: int, total: Optional[int] = None):
        """A draft tree (mode "tree"): (node target ids, parent node index (-1 = root), new cache); with
        `total`, only the `total` best nodes of the expanded tree (EAGLE-2's re-ranking)."""
        raise NotImplementedError

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        """Write the head folder vLLM / SGLang load; returns its absolute path."""
        raise NotImplementedError

    def recognises_head(self, head_config: Mapping) -> bool:
        """Whether a head folder's config.json is this family's format."""
        return False

    def load_head(self, folder: str):
        """(params as numpy, draft config, DraftVocab) of a head folder of this family."""
        raise NotImplementedError

    def vllm_speculative_config(self, draft: str, head_config: Mapping, num_spec_tokens: int) -> dict:
        """vLLM's `--speculative-config` for the head at `draft`."""
        raise NotImplementedError

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        """Check the head for serving and say what serve_cmd prints around the engine commands."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------
FAMILIES: dict[str, DraftFamily] = {}  # draft.type -> family, in registration order


def register(family: DraftFamily) -> DraftFamily:
    """Add `family` under its draft_type (a second family of the same type is refused)."""
    name = family.draft_type
    if not name:
        raise ValueError(f"{type(family).__name__} has no draft_type")
    if name in FAMILIES and type(FAMILIES[name]) is not type(family):
        raise ValueError(f"draft.type {name!r} is registered twice: {type(FAMILIES[name]).__name__} and "
                         f"{type(family).__name__}")
    FAMILIES[name] = family
    return family


def unregister(draft_type: str) -> None:
    """Remove a family (tests that register a family of their own)."""
    FAMILIES.pop(draft_type, None)


def known_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def _known(names) -> str:
    return ", ".join(repr(n) for n in names)


def family_for_type(draft_type: str) -> DraftFamily:
    """The family selected by `draft.type`."""
    try:
        return FAMILIES[draft_type]
    except KeyError:
        raise ValueError(f"draft.type {draft_type!r} is not a draft family this specjax knows; known: "
                         f"{_known(FAMILIES)}") from None


def family_of(draft_cfg) -> DraftFamily:
    """The family a draft config object belongs to."""
    for family in FAMILIES.values():
        if family.owns(draft_cfg):
            return family
    raise ValueError(f"{type(draft_cfg).__name__} is the draft config of no registered draft family; known: "
                     f"{_known(FAMILIES)}")


def meta_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(f.meta_name for f in FAMILIES.values()))


def family_from_meta(name: Optional[str]) -> DraftFamily:
    """The family that reads a run_meta.json draft_config back, by its `draft_family` (None: the
    default family). Families sharing a meta name share the config class; the first registered
    answers."""
    name = DEFAULT_META_NAME if name is None else name
    for family in FAMILIES.values():
        if family.meta_name == name:
            return family
    raise ValueError(f"{META_KEY}={name!r} is not a draft family this specjax knows ({_known(meta_names())}); "
                     "export the run with the specjax version that trained it.")


def draft_config_from_meta(meta: Mapping):
    """The draft config of a run_meta.json dict (its draft_config and draft_family)."""
    return family_from_meta(meta.get(META_KEY)).config_from_dict(dict(meta["draft_config"]))


def family_for_head(head_config: Mapping) -> DraftFamily:
    """The family whose head format a folder's config.json is: the first family that recognises it,
    else the default family (whose validator then says what is wrong)."""
    for family in FAMILIES.values():
        if family.recognises_head(head_config):
            return family
    return family_from_meta(None)


def read_head_config(folder: str) -> Optional[dict]:
    """A head folder's config.json as a dict (read size- and depth-bounded; a file that is no JSON
    object raises ValueError naming it), None when the folder has none."""
    path = os.path.join(os.path.expanduser(os.fspath(folder)), "config.json")
    if not os.path.isfile(path):
        return None
    return read_config_json(path, "head config")


def family_for_folder(folder: str, default: Optional[DraftFamily] = None) -> DraftFamily:
    """The family of a head folder (its config.json). With `default`, a folder without a readable
    config.json is `default`'s (its own reader then says what is wrong); without, a missing one is the
    default family's and an unreadable one raises."""
    try:
        config = read_head_config(folder)
    except (OSError, ValueError):
        if default is None:
            raise
        return default
    if config is None:
        return default or family_from_meta(None)
    return family_for_head(config)


def resolve_mask_token_id(cfg, target) -> int:
    """The mask token of a draft whose undrafted positions read one (P-EAGLE, DFlash):
    draft.mask_token_id, else the target config's pad_token_id, else its (first) eos_token_id."""
    if cfg.draft.mask_token_id is not None:
        return int(cfg.draft.mask_token_id)
    hf = getattr(target, "hf_config", {}) or {}
    hf = hf.get("text_config", hf)
    for key in ("pad_token_id", "eos_token_id"):
        v = hf.get(key)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    raise ValueError(f"draft.type={cfg.draft.type} needs a mask token and the target config has neither "
                     "pad_token_id nor eos_token_id; set draft.mask_token_id to a token id of the target vocab.")


def target_config_for_serving(target: str, manifest: Optional[Mapping]) -> tuple[Optional[dict], Optional[str]]:
    """(the target's config.json, where it came from) for serving a head: `target` when it is a local
    folder, else the head manifest's target_config; (None, None) when neither is readable."""
    path = os.path.join(os.path.expanduser(target), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f), path
    if manifest and isinstance(manifest.get("target_config"), dict):
        return manifest["target_config"], "the draft's specjax_manifest.json"
    return None, None


def section_keys(section_class: type) -> list[str]:
    return [f.name for f in dataclasses.fields(section_class)]


def foreign_draft_key_error(family: DraftFamily, key: str, source: str) -> Optional[ConfigError]:
    """The error for a draft.* key that is not `family`'s but another family's, else None."""
    owners = [f for f in FAMILIES.values() if f is not family and key in section_keys(f.section_class)]
    if not owners:
        return None
    types = " or ".join(f"draft.type={f.draft_type}" for f in owners)
    return ConfigError(f"{source}: `draft.{key}` is not a key of draft.type={family.draft_type} "
                       f"({family.display_name}); it belongs to {types}. Fix: remove it or set "
                       f"draft.type={owners[0].draft_type}.")

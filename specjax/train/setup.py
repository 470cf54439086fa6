"""The run set-up: everything a train step needs, built from a Config in one place.

The training loop, `--compile-only` (`specjax.train.aot`) and `specjax.targets.shapes` all take the
draft config, the TTT config, the optimizer and the jitted step functions from `build_run_setup`, so
the three cannot drift apart (one of them once dropped fc_norm and the kernel choices). The target
is either loaded (`build_target`, weights streamed onto their shards) or abstract
(`abstract_target`, ShapeDtypeStructs from the architecture's weight map: nothing read, nothing
allocated); the set-up does not care which.

Order of a run: `preflight` (jinja2, tokenizer, template: before anything expensive) -> target ->
tokenizer -> data -> `build_vocab` -> `build_run_setup` -> the loop (specjax.train.loop).
"""
from __future__ import annotations

import dataclasses
import importlib.resources as ir
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from specjax import mesh as meshlib
from specjax.config import Config
from specjax.data.chat import TemplateLimits, check_chat_template
from specjax.drafts import dflash, draft_types, eagle3
from specjax.drafts.ttt import TTTConfig
from specjax.drafts.vocab import DraftVocab, build_draft_vocab, token_counts_from_examples
from specjax.targets import load_target, validate_aux_layer_ids
from specjax.targets.base import tree_set
from specjax.targets.loading import read_hf_config
from specjax.targets.registry import get_target_class
from specjax.targets.shapes import abstract_params
from specjax.train.optim import lr_schedule, make_optimizer
from specjax.train.step import DFlashObjective, StepFns, build_step_fns
from specjax_converters.dflash_import import is_dflash_folder, warm_start_dflash_params
from specjax_converters.eagle3_import import warm_start_params

VOCAB_FILE = "draft_vocab.npz"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# ---------------------------------------------------------------------------------------------
# paths and the environment
# ---------------------------------------------------------------------------------------------
def resolve_path(p: str) -> str:
    """`pkg://specjax/assets/x` -> the installed package file; other paths unchanged. Dataset presets
    (`preset://sharegpt`) pass through: specjax.data.sources reads them (and refuses evaluation
    presets as training data)."""
    if p.startswith("preset://"):
        return p
    if p.startswith("pkg://"):
        pkg, _, rel = p[len("pkg://"):].partition("/")
        return str(ir.files(pkg).joinpath(rel))
    return p


def check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe.{os.getpid()}")  # per process: hosts may share the folder
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OSError(f"run.output_dir {path!r} is not writable ({e}); choose another run.output_dir.") from e


def build_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    tok_path = cfg.data.tokenizer or cfg.target.path
    try:
        return AutoTokenizer.from_pretrained(tok_path, trust_remote_code=cfg.target.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(
            f"cannot load the tokenizer from {tok_path!r} ({type(e).__name__}: {e}); point data.tokenizer "
            f"(or target.path) at a folder with tokenizer.json / tokenizer_config.json.") from e


def preflight(cfg: Config):
    """Problems of the machine or the config that no row causes, checked before any expensive stage
    (GGUF conversion, regeneration, the target build, compilation): jinja2 importable, and, when the
    tokenizer is already on disk, that it loads and its chat template renders. Raises one ValueError
    naming the cause and the fix. Returns the tokenizer when it was loaded, else None (the demo and
    GGUF targets write theirs during the build)."""

    check_chat_template()
    tok_path = cfg.data.tokenizer or cfg.target.path
    if not tok_path or not any(os.path.isfile(os.path.join(tok_path, f)) for f in _TOKENIZER_FILES):
        return None
    tokenizer = build_tokenizer(cfg)
    check_chat_template(tokenizer, cfg.data.chat_template, TemplateLimits.of(cfg.data))
    return tokenizer


# ---------------------------------------------------------------------------------------------
# the target
# ---------------------------------------------------------------------------------------------
def kernel_overrides(cfg: Config, cls) -> dict:
    """`kernels.moe` / `kernels.ssd` / `kernels.target_attention*` / `kernels.decode_attention` as the target config's runtime
    fields (for the architectures that have MoE experts / an SSD scan / attention; others ignore them)."""
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    out = {}
    if "moe_implementation" in fields:
        out["moe_implementation"] = cfg.kernels.moe
    if "ssd_implementation" in fields:
        out["ssd_implementation"] = cfg.kernels.ssd
    if "attention_implementation" in fields:
        out["attention_implementation"] = cfg.kernels.target_attention
    if "decode_attention_implementation" in fields:
        out["decode_attention_implementation"] = cfg.kernels.decode_attention
    if "attention_q_block" in fields and cfg.kernels.target_attention_q_block:
        out["attention_q_block"] = cfg.kernels.target_attention_q_block
    return out


def target_shardings(cls, config, mesh, exclude=()):
    """NamedShardings for every target leaf from its weight map, known before any weight is read,
    so the loader puts each tensor straight onto its shards (no full host copy of a big target).
    `exclude`: mesh axes not to shard over (parallelism.target_excluded_axes)."""

    logical, shapes = {}, {}
    for spec in cls.weight_specs(config):
        tree_set(logical, spec.path, spec.axes)
        tree_set(shapes, spec.path, jax.ShapeDtypeStruct(spec.shape, jnp.float32))
    return meshlib.tree_shardings(mesh, logical, shapes, exclude)


def build_target(cfg: Config, mesh=None):
    """The configured target with its weights (built first for the demo, converted first from a
    GGUF), each tensor placed on its shards of `mesh` as it is read."""

    path = cfg.target.path
    if not path:
        raise ValueError("target.path is empty: set it to a Hugging Face folder (config.json + *.safetensors).")
    if cfg.target.build_demo:  # the demo and GGUF builders (tokenizers, torch) load only when configured
        from specjax.demo import ensure_demo_target

        ensure_demo_target(path)
    if cfg.target.gguf:
        from specjax.convert import ensure_target_folder

        ensure_target_folder(path, cfg.target.gguf)
    hf = read_hf_config(path)
    cls = get_target_class(hf)
    overrides = kernel_overrides(cfg, cls)
    shardings = None if mesh is None else target_shardings(cls, cls.config_from_hf(hf, **overrides), mesh,
                                                           cfg.parallelism.target_excluded_axes)
    return load_target(path, dtype=cfg.target.dtype, shardings=shardings, **overrides)


def abstract_target(cfg: Config, hf: Mapping[str, Any] | None = None, dtype: str | None = None):
    """The configured target with abstract params: ShapeDtypeStructs built from the architecture's
    weight map (the tree the loader fills), so every registered architecture works and nothing is
    allocated. The target config gets the configured kernel choices as `build_target`'s does. `hf`
    defaults to target.path's config.json, `dtype` to target.dtype."""

    if hf is None:
        hf = read_hf_config(cfg.target.path)
    cls = get_target_class(hf)
    tconfig = cls.config_from_hf(hf, **kernel_overrides(cfg, cls))
    return cls(tconfig, hf, abstract_params(cls, tconfig, dtype or cfg.target.dtype))


# ---------------------------------------------------------------------------------------------
# the draft
# ---------------------------------------------------------------------------------------------
def build_vocab(cfg: Config, examples, vocab_size: int, out_dir: str):
    path = os.path.join(out_dir, VOCAB_FILE)
    if os.path.exists(path):  # resume: the vocab must not change under a checkpoint
        vocab = DraftVocab.load(path)
        if vocab.t2d.shape[0] != vocab_size or vocab.draft_ids.shape[0] != cfg.draft.draft_vocab_size:
            raise ValueError(
                f"{path} was built for V={vocab.t2d.shape[0]}, Vd={vocab.draft_ids.shape[0]} but this run has "
                f"V={vocab_size}, Vd={cfg.draft.draft_vocab_size}; use a new run.output_dir."
            )
        return vocab
    counts = token_counts_from_examples(examples, vocab_size)
    vocab = build_draft_vocab(counts, cfg.draft.draft_vocab_size)
    vocab.validate()
    if jax.process_index() == 0:  # every process computes the same vocab; one writes it
        vocab.save(path)
    return vocab


def resolve_aux_ids(cfg: Config, target) -> tuple[int, ...]:
    """target.aux_layer_ids (output-of-layer-k), else the draft type's default: EAGLE-3's three taps,
    or for DFlash one per draft layer spread over the target (dflash.default_target_layer_ids)."""
    if cfg.target.aux_layer_ids:
        ids = cfg.target.aux_layer_ids
    elif cfg.draft.type == "dflash":
        ids = dflash.default_target_layer_ids(target.num_layers, cfg.draft.num_layers)
        if len(set(ids)) != len(ids):
            raise ValueError(f"draft.type=dflash: the default taps {list(ids)} for {cfg.draft.num_layers} draft layers "
                             f"of a {target.num_layers}-layer target repeat a layer; set target.aux_layer_ids.")
    else:
        ids = target.default_aux_layer_ids()
    return tuple(int(i) for i in validate_aux_layer_ids(tuple(ids), target.num_layers))


def make_draft_config(cfg: Config, target, aux_ids) -> draft_types.DraftConfigType:
    """The one translation of the `draft` section (+ the target's shapes) into the draft's config:
    an Eagle3Config (eagle3, p_eagle) or a DFlashConfig (dflash; its taps are `aux_ids`)."""
    d = cfg.draft
    # e.g. hybrid Mamba targets: the draft's KV heads must equal the target's (vLLM KV-cache pages);
    # checked before training, not at export
    check = getattr(type(target), "check_draft_compat", None)
    if check is not None:
        check(target.config, d.num_key_value_heads)
    if d.type == "dflash":
        return _dflash_config(cfg, target, aux_ids)
    parallel = d.type == "p_eagle"
    if not parallel and d.mask_token_id is not None:
        raise ValueError(f"draft.mask_token_id={d.mask_token_id} is only read by draft.type=p_eagle or dflash; "
                         "remove it or set draft.type=p_eagle.")
    return eagle3.config_from_target(
        target.config, draft_vocab_size=d.draft_vocab_size, aux_layer_ids=aux_ids,
        intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
        fc_norm=d.fc_norm, norm_output=d.norm_output, num_layers=d.num_layers,
        parallel_drafting=parallel, mask_token_id=mask_token_id(cfg, target) if parallel else None,
    )


def _dflash_config(cfg: Config, target, aux_ids) -> dflash.DFlashConfig:
    """DFlash: the draft's width, norms and RoPE are the target's; heads / head_dim / MLP width
    default to the target's too. A config problem is reported with the draft.* key to change."""
    d, t = cfg.draft, target.config
    base = dflash.config_from_target(
        t, draft_vocab_size=d.draft_vocab_size, mask_token_id=mask_token_id(cfg, target), num_layers=d.num_layers,
        block_size=d.block_size, target_layer_ids=aux_ids, intermediate_size=d.intermediate_size,
        sample_from_anchor=d.sample_from_anchor)
    overrides = {k: v for k, v in (("num_attention_heads", d.num_attention_heads),
                                   ("num_key_value_heads", d.num_key_value_heads), ("head_dim", d.head_dim))
                 if v is not None}
    out = dataclasses.replace(base, **overrides) if overrides else base
    try:
        out.validate()
    except ValueError as e:
        raise ValueError(f"draft.type=dflash: {e} (the draft.* key of the same name sets it)") from None
    return out


def mask_token_id(cfg: Config, target) -> int:
    """The mask token of P-EAGLE and DFlash: draft.mask_token_id, else the target config's
    pad_token_id, else its (first) eos_token_id."""
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


def make_ttt_config(cfg: Config) -> TTTConfig:
    """draft.ttt_steps / step_decay with the configured kernels (kernels.ttt_attention / soft_ce) and
    objective (train.loss and its LK settings; P-EAGLE's COD sampling keyed by run.seed)."""
    t = cfg.train
    return TTTConfig(ttt_steps=cfg.draft.ttt_steps, step_decay=cfg.draft.step_decay,
                     attention_impl=cfg.kernels.ttt_attention, soft_ce_impl=cfg.kernels.soft_ce,
                     loss=t.loss, kl_scale=t.lk_kl_scale, kl_decay=t.lk_kl_decay, eta=t.lk_eta,
                     cod_ratio=t.cod_ratio, cod_ratio_min=t.cod_ratio_min, cod_seed=cfg.run.seed)


def make_dflash_objective(cfg: Config, draft_cfg: dflash.DFlashConfig) -> DFlashObjective:
    """train.dflash_* as DFlash's loss config (checked against the draft config), anchors keyed by run.seed."""
    t = cfg.train
    loss = dflash.DFlashLossConfig(objective=t.dflash_objective, num_anchors=t.dflash_anchors,
                                   loss_decay_gamma=t.dflash_decay_gamma or None)
    loss.validate(draft_cfg)
    return DFlashObjective(loss=loss, anchor_seed=cfg.run.seed)


def make_objective_config(cfg: Config, draft_cfg):
    """What the loss reads besides the draft config: the TTT config, or DFlash's objective."""
    if draft_types.is_dflash(draft_cfg):
        return make_dflash_objective(cfg, draft_cfg)
    return make_ttt_config(cfg)


def make_mesh(cfg: Config):
    return meshlib.make_mesh({a: getattr(cfg.parallelism, a) for a in meshlib.MESH_AXES})


def check_batch_fits(cfg: Config, mesh, batch_size: int | None = None) -> None:
    """The global batch splits evenly over the batch-sharded mesh axes and over the processes."""
    b = int(batch_size or cfg.data.batch_size)
    n_batch_shards = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))
    if b % n_batch_shards:
        raise ValueError(
            f"data.batch_size={b} must be divisible by data*fsdp*expert={n_batch_shards} "
            f"(mesh {dict(mesh.shape)}); change data.batch_size or parallelism.*."
        )
    if b % jax.process_count():
        raise ValueError(f"data.batch_size={b} must be divisible by the {jax.process_count()} processes.")


# ---------------------------------------------------------------------------------------------
# the set-up
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSetup:
    """What the jitted step is built from; frozen, shared by the loop, --compile-only and shapes."""
    cfg: Config
    mesh: Any
    target: Any  # loaded or abstract params
    draft_config: draft_types.DraftConfigType
    ttt: Any  # TTTConfig (eagle3, p_eagle) or DFlashObjective (dflash): make_objective_config
    optimizer: Any
    schedule: Callable[[int], Any]
    compute_dtype: Any
    draft_params_shape: Any  # ShapeDtypeStructs of the draft params
    fns: StepFns

    def init_draft_params(self, vocab=None):
        """The configured initialisation: random from run.seed, then the published head of
        draft.init_from (checked against the draft config; rows matched by target id via `vocab`):
        an EAGLE-3 head for eagle3 / p_eagle, a DFlash export for dflash."""
        cfg = self.cfg
        if draft_types.is_dflash(self.draft_config):
            params = draft_types.init_draft_params(self.draft_config, jax.random.key(cfg.run.seed),
                                                   std=cfg.draft.init_std,
                                                   lm_head_rows=dflash_lm_head_rows(self.target, vocab))
            if cfg.draft.init_from:
                params = warm_start_dflash_params(cfg.draft.init_from, self.draft_config, vocab, params)
            return params
        if cfg.draft.init_from and is_dflash_folder(cfg.draft.init_from):
            raise ValueError(f"draft.init_from={cfg.draft.init_from} is a DFlash head (a block drafter) but "
                             f"draft.type is {cfg.draft.type!r}. Fix: set draft.type=dflash to start from it, or "
                             "point draft.init_from at an EAGLE-3 head")
        params = eagle3.init_draft_params(self.draft_config, jax.random.key(cfg.run.seed), std=cfg.draft.init_std)
        if cfg.draft.init_from:
            params = warm_start_params(cfg.draft.init_from, self.draft_config, vocab, params)
        return params


def dflash_lm_head_rows(target, vocab):
    """The target's lm_head rows of the draft vocab (draft order, fp32 on the host): a DFlash head's
    initial lm_head. None without a vocab or with abstract target params."""
    if vocab is None:
        return None
    head = target.lm_head_weight(target.params)
    if isinstance(head, jax.ShapeDtypeStruct):
        return None
    return jnp.take(jnp.asarray(head, jnp.float32), jnp.asarray(vocab.draft_ids, jnp.int32), axis=0)


def build_run_setup(cfg: Config, target, mesh, dtype: str | None = None) -> RunSetup:
    """Draft config, TTT config, optimizer and step functions for `target` on `mesh`. As in every
    run, the step computes in float32 for a float32 target and in bfloat16 otherwise (`dtype`
    defaults to target.dtype)."""
    aux_ids = resolve_aux_ids(cfg, target)
    draft_cfg = make_draft_config(cfg, target, aux_ids)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    compute_dtype = jnp.float32 if (dtype or cfg.target.dtype) == "float32" else jnp.bfloat16
    dshape = jax.eval_shape(lambda: draft_types.init_draft_params(draft_cfg, jax.random.key(0)))
    ttt = make_objective_config(cfg, draft_cfg)
    fns = build_step_fns(target, target.params, dshape, draft_cfg, ttt, optimizer, mesh, compute_dtype,
                         target_exclude=cfg.parallelism.target_excluded_axes)
    return RunSetup(cfg=cfg, mesh=mesh, target=target, draft_config=draft_cfg, ttt=ttt,
                    optimizer=optimizer, schedule=lr_schedule(cfg.optim, cfg.train.steps),
                    compute_dtype=compute_dtype, draft_params_shape=dshape, fns=fns)

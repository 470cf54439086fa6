"""Self-contained demo assets: a synthetic chat dataset, a tiny BPE tokenizer and a tiny trained
Llama target, all built locally so the default CPU job needs no downloads.

    python -m specjax.demo write-data          # regenerate specjax/assets/demo_chat.jsonl
    python -m specjax.demo build --out DIR     # tokenizer + trained target into DIR

The dataset is deliberately formulaic (fixed answer shapes, small closed vocabularies) so that a
~1M-parameter target trained for about a minute becomes a confident, low-entropy model of
the assistant turns, which is what gives an EAGLE-3 draft something worth learning.
Only the dataset is shipped; tokenizer (bit-identical every time) and target (same seed and data
order; weights agree up to float reduction order on multithreaded CPUs) are rebuilt from it and
cached by `ensure_demo_assets` / `ensure_demo_target`.

Modules: `tasks` (the synthetic chats, ChatML rendering, the data file), `tokenizer` (the BPE),
`pretrain` (the tiny target and its training), `assets` (the build cache), `cli`
(`python -m specjax.demo`). The names below are the public surface callers import from here.
"""
# numpy, jax, optax, tokenizers, transformers and the JAX target code (specjax.targets,
# specjax.train.optim) are imported inside the functions that use them, in every module here, so
# that importing this package or running `write-data` loads none of them.
from specjax.demo.assets import BUILD_MARKER, DEMO_BUILD_VERSION, ensure_demo_assets, ensure_demo_target
from specjax.demo.cli import main
from specjax.demo.pretrain import (DEMO_OPTIM, DEMO_TARGET_DEFAULTS, build_demo_target, causal_lm_loss,
                                   demo_optim_config, demo_target_hf_config, pack_documents,
                                   pretrain_demo_target, tokenize_demo_documents)
from specjax.demo.tasks import (ASSETS_DIR, CHAT_TEMPLATE, DEMO_DATA_PATH, DEMO_NUM_CONVERSATIONS,
                                DEMO_SEED, EOT, IM_END, IM_START, SPECIAL_TOKENS,
                                conversations_to_jsonl, generate_demo_conversations,
                                read_demo_conversations, render_chatml, write_demo_data)
from specjax.demo.tokenizer import build_demo_tokenizer, demo_tokenizer_texts, save_tokenizer_portable

__all__ = [
    "ASSETS_DIR", "BUILD_MARKER", "CHAT_TEMPLATE", "DEMO_BUILD_VERSION", "DEMO_DATA_PATH", "DEMO_NUM_CONVERSATIONS",
    "DEMO_OPTIM", "DEMO_SEED", "DEMO_TARGET_DEFAULTS", "EOT", "IM_END", "IM_START", "SPECIAL_TOKENS",
    "build_demo_target", "build_demo_tokenizer", "causal_lm_loss", "conversations_to_jsonl",
    "demo_optim_config", "demo_target_hf_config", "demo_tokenizer_texts", "ensure_demo_assets",
    "ensure_demo_target", "generate_demo_conversations", "main", "pack_documents",
    "pretrain_demo_target", "read_demo_conversations", "render_chatml", "save_tokenizer_portable",
    "tokenize_demo_documents", "write_demo_data",
]

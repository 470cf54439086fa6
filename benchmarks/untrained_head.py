"""Export an untrained (random-init) EAGLE-3 head with a trained run's draft config and vocab: the
floor for acceptance measurements (`python -m specjax.eval --draft <out>`).

    python benchmarks/untrained_head.py --config configs/smollm2_eagle3.yaml --out runs/smollm2_untrained_head

Without a trained run: `--target DIR --draft-vocab-size N` (draft vocab = target ids 0..N-1, default aux
layers). Such a head accepts (almost) nothing, but every step still verifies K+1 tokens in one target
call, which is what a losslessness check of the decoder needs.
"""
import argparse

import jax
import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", help="the trained run's config (its draft_vocab.npz is reused)")
    p.add_argument("--target", help="instead of --config: a target folder")
    p.add_argument("--draft-vocab-size", type=int, default=16384, help="with --target")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import os

    from specjax.config import load_config
    from specjax.drafts import eagle3
    from specjax.drafts.vocab import DraftVocab
    from specjax import run_files
    from specjax.targets import load_target
    from specjax.train.setup import make_draft_config, resolve_aux_ids
    from specjax_converters.eagle3_export import export_eagle3

    if (args.config is None) == (args.target is None):
        p.error("give exactly one of --config (a trained run) or --target (a target folder)")
    if args.config:
        cfg = load_config(args.config)
        target = load_target(cfg.target.path, dtype="float32")
        dcfg = make_draft_config(cfg, target, resolve_aux_ids(cfg, target))
        vocab = DraftVocab.load(run_files.vocab_path(cfg.run.output_dir))
        params = eagle3.init_draft_params(dcfg, jax.random.key(args.seed), std=cfg.draft.init_std)
    else:
        target = load_target(args.target, dtype="float32")
        n = min(args.draft_vocab_size, target.config.vocab_size)
        dcfg = eagle3.config_from_target(target.config, draft_vocab_size=n, aux_layer_ids=target.default_aux_layer_ids())
        vocab = DraftVocab.from_ids(np.arange(n), target.config.vocab_size)
        params = eagle3.init_draft_params(dcfg, jax.random.key(args.seed))
    params = jax.tree_util.tree_map(np.asarray, params)
    print(export_eagle3(params, dcfg, vocab, target.hf_config, args.out, dtype="float32"))


if __name__ == "__main__":
    main()

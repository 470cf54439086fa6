"""Export an untrained (random-init) EAGLE-3 head with a trained run's draft config and vocab: the
floor for acceptance measurements (`python -m specjax.eval --draft <out>`).

    python benchmarks/untrained_head.py --config configs/smollm2_eagle3.yaml --out runs/smollm2_untrained_head
"""
import argparse

import jax
import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="the trained run's config (its draft_vocab.npz is reused)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import os

    from specjax.config import load_config
    from specjax.drafts import eagle3
    from specjax.drafts.vocab import DraftVocab
    from specjax.targets import load_target
    from specjax.train.loop import make_draft_config, resolve_aux_ids
    from specjax_converters.eagle3_export import export_eagle3

    cfg = load_config(args.config)
    target = load_target(cfg.target.path, dtype="float32")
    dcfg = make_draft_config(cfg, target, resolve_aux_ids(cfg, target))
    vocab = DraftVocab.load(os.path.join(cfg.run.output_dir, "draft_vocab.npz"))
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(dcfg, jax.random.key(args.seed),
                                                                          std=cfg.draft.init_std))
    print(export_eagle3(params, dcfg, vocab, target.hf_config, args.out, dtype="float32"))


if __name__ == "__main__":
    main()

"""configs/looped_eagle3.yaml exports the aux ids the Nanbeige4.2-3B EAGLE-3 card gives.

The card (a looped target: 22 layers run twice, virtual depth 44) states the key vLLM reads,
`eagle_aux_hidden_state_layer_ids = [3, 23, 41]`, as hidden_states indices (44 = the last virtual
layer). specjax's `target.aux_layer_ids` are output-of-layer ids, one lower (docs/eagle3-format.md,
"Aux layer ids"). The export of a run with that config must reproduce the card's key exactly. The
target is the config's own 22 x 2 depth at reduced width, so the ids are checked against the
same virtual depth."""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax.config import load_config
from specjax.drafts import eagle3
from specjax.drafts.vocab import DraftVocab
from specjax.targets import abstract
from specjax.targets.loading import read_hf_config
from specjax.train.setup import make_draft_config, resolve_aux_ids
from specjax_converters.eagle3_export import export_eagle3
from specjax_converters.head_formats import errors, validate_folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARD_TOP_LEVEL_IDS = [3, 23, 41]  # Nanbeige4.2-3B-EAGLE3 card, "Aux feature taps are virtual-depth ids"


def test_looped_config_exports_the_cards_top_level_ids(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs", "looped_eagle3.yaml"),
                      ["draft.draft_vocab_size=64", "draft.intermediate_size=96"])
    full = read_hf_config(os.path.join(ROOT, cfg.target.path))
    hf = abstract.reduced_hf_config(full, vocab_size=256)
    assert (hf["num_hidden_layers"], hf["num_loops"]) == (22, 2)  # the card's depth is kept
    target = abstract.make_target(hf)
    assert target.num_layers == 44

    aux = resolve_aux_ids(cfg, target)
    assert aux == (2, 22, 40)  # output-of-virtual-layer ids: early pass 1, early pass 2, late pass 2
    dcfg = make_draft_config(cfg, target, aux)
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(dcfg, jax.random.key(0)))
    vocab = DraftVocab.from_ids(np.arange(64), 256)
    out = export_eagle3(params, dcfg, vocab, hf, tmp_path / "head", dtype="fp32")

    conf = json.loads(open(os.path.join(out, "config.json")).read())
    assert conf["eagle_aux_hidden_state_layer_ids"] == CARD_TOP_LEVEL_IDS
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 22, 40]
    assert conf["target_layer_count"] == 44 and conf["target_num_loops"] == 2
    assert not errors(validate_folder(out)[0])

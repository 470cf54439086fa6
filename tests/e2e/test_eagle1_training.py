"""draft.type=eagle end to end: the loop trains an EAGLE-1 head (feature regression on the target's final
hidden state, the paper's loss weights) on the tiny target (fp32, the jitted train step), its loss
falls over a few steps, run_meta.json names the family, the export at the end is the folder vLLM's
"eagle" method loads and the EAGLE-1 validator passes, specjax.eval reads it back and decodes
losslessly as a chain (EAGLE-1) and as a draft tree (EAGLE-2), also in the batched device loop,
serve_cmd prints vLLM's eagle method for it, and `python -m specjax.export` re-exports the run from
its checkpoint with the same weights."""
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file

from specjax.drafts.eagle1 import Eagle1Config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

RUN = ("draft.type=eagle", "draft.draft_vocab_size=320", "optim.lr=2e-2", "optim.warmup_ratio=0.0", "train.steps=60",
       "export.at_end=true", "export.dtype=float32")
PROMPT = [1, 274, 201, 50, 281, 262, 71, 223, 69, 81, 79, 82]  # a chat-formatted demo prompt


def test_eagle1_head_trains_exports_and_decodes(tiny_target, tmp_path):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.eval.spec_loop import SpecLoop
    from specjax.export import export_run
    from specjax.serve_cmd import build
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics
    from specjax_converters.head_formats import errors, validate_folder

    run = tmp_path / "run"
    head = train(inprocess_config(tiny_target, run, *RUN)).export_dir
    rows = read_metrics(str(run))
    losses = [r["loss"] for r in rows]
    assert len(losses) == 60 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert all("loss_reg" in r and "loss_token" in r for r in rows)

    assert json.loads((run / "run_meta.json").read_text())["draft_family"] == "eagle"
    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["architectures"] == ["EagleLlamaForCausalLM"] and conf["num_hidden_layers"] == 1
    assert set(load_file(os.path.join(head, "model.safetensors"))) == {
        "fc.weight", *(f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "post_attention_layernorm",
                                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
    findings, info = validate_folder(head, target=tiny_target)
    assert info["layout"] == "eagle1" and not errors(findings), [str(f) for f in findings]

    draft = load_draft(head)
    assert type(draft.config) is Eagle1Config
    target = load_target(tiny_target, dtype="float32")
    greedy = generate(target, [PROMPT], max_new_tokens=16)[0][:16]
    chain = SpecDecoder(target, draft, num_spec_tokens=3)
    got = chain.generate(PROMPT, max_new_tokens=16)
    assert got.tokens == greedy and sum(got.accepted_per_position) > 0, got
    tree = SpecDecoder(target, draft, num_spec_tokens=3, mode="tree", tree_top_k=2, tree_max_width=3)
    assert tree.generate(PROMPT, max_new_tokens=16).tokens == greedy
    reranked = SpecDecoder(target, draft, num_spec_tokens=3, mode="tree", tree_top_k=2, tree_total_tokens=4)
    assert reranked.verify_len == 5 and reranked.generate(PROMPT, max_new_tokens=16).tokens == greedy  # EAGLE-2
    (loop,) = SpecLoop(chain).generate([PROMPT], max_new_tokens=16)
    assert loop.tokens == greedy and loop.accepted_per_position == got.accepted_per_position

    code, text = build(head, tiny_target, engine="vllm")
    assert code == 0 and '"method": "eagle"' in text and '"num_speculative_tokens": 3' in text, text

    again = export_run(str(run), str(tmp_path / "again"), dtype="float32")
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (head, again))
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)

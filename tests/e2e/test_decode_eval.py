"""decode_eval during training: a short run on the tiny target measures real tau (speculative
decoding with the draft being trained) every `decode_eval.every_steps` and at the end, logs it as
`decode_tau/<dataset>` beside the proxies and returns it in RunResult.decode_eval."""
import json
import math

from specjax.config import load_config
from specjax.train.metrics import read_metrics


def test_decode_eval_logs_real_tau(tiny_target, tmp_path):
    from specjax.train.loop import train

    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n"
                               for c in ("Name three colours.", "What is two plus two?", "unused")))
    out = tmp_path / "run"
    k = 3
    cfg = load_config(None, [
        f"target.path={tiny_target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=200",
        "data.seq_length=128", "data.batch_size=8", "data.val_fraction=0.05",
        "draft.ttt_steps=2", "draft.draft_vocab_size=128", "optim.lr=3e-3",
        "train.steps=4", "train.log_every=1", "train.eval_batches=1", "train.progress=false",
        "checkpoint.every_steps=0", "export.at_end=false",
        "decode_eval.every_steps=2", "decode_eval.at_end=true", f"decode_eval.prompts=[{prompts}]",
        "decode_eval.limit=2", f"decode_eval.num_spec_tokens={k}", "decode_eval.max_new_tokens=12",
    ])
    res = train(cfg)
    rows = read_metrics(str(out), "decode")
    # every 2 steps: step 2 in the loop, step 4 at the end (the last step is measured once)
    assert [r["step"] for r in rows] == [2, 4]
    assert sorted(res.decode_eval) == [2, 4]
    for r in rows:
        taus = {key: v for key, v in r.items() if key.startswith("decode_tau/")}
        assert len(taus) == 1, r
        (name, tau), = taus.items()
        assert math.isfinite(tau) and 1.0 <= tau <= k + 1
        ds = name.split("/", 1)[1]
        accept = [r[f"decode_accept_{i}/{ds}"] for i in range(k)]
        assert all(0.0 <= a <= 1.0 for a in accept)
        # a step emits its accepted drafts plus the bonus, except that an EOS or max_new_tokens may
        # cut the last one: sum(rates) <= tau <= 1 + sum(rates)
        assert sum(accept) - 1e-12 <= tau <= 1.0 + sum(accept) + 1e-12
        summary = res.decode_eval[r["step"]][ds]
        assert summary["tau"] == tau and summary["n_prompts"] == 2 and summary["steps"] >= 1
    # the training rows are untouched by the extra split
    assert [r["step"] for r in read_metrics(str(out), "train")] == [1, 2, 3, 4]

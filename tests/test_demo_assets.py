"""The embedded demo assets: shipped dataset, local tokenizer, locally trained tiny Llama target."""
import json

import numpy as np
import pytest

from specjax import demo

# Small enough that a build (compile + a few steps + export) takes seconds on 2 CPU cores.
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, steps=3, seq_len=128,
            batch_size=4, lr=3e-3, seed=0)


@pytest.fixture(scope="module")
def rows():
    return demo.read_demo_conversations(demo.DEMO_DATA_PATH)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, rows):
    d = tmp_path_factory.mktemp("demo_tok")
    demo.build_demo_tokenizer(demo.demo_tokenizer_texts(rows), d)
    return d


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, tok_dir):
    d = tmp_path_factory.mktemp("demo_target")
    info = demo.build_demo_target(d, data_path=demo.DEMO_DATA_PATH, tokenizer_dir=tok_dir, log=None, **TINY)
    return d, info


# ------------------------------------------------------------------------------------- dataset
def test_shipped_dataset_regenerates_byte_identically(tmp_path):
    shipped = demo.DEMO_DATA_PATH.read_bytes()
    assert len(shipped) < 1_000_000
    assert demo.conversations_to_jsonl(demo.generate_demo_conversations()).encode() == shipped
    out = tmp_path / "d.jsonl"
    assert demo.main(["write-data", "--out", str(out)]) == 0
    assert out.read_bytes() == shipped


def test_dataset_schema(rows):
    assert len(rows) == demo.DEMO_NUM_CONVERSATIONS
    n_turns = set()
    for r in rows:
        assert set(r) == {"messages"}
        msgs = r["messages"]
        if msgs[0]["role"] == "system":
            msgs = msgs[1:]
        assert len(msgs) % 2 == 0 and 2 <= len(msgs) <= 6
        n_turns.add(len(msgs) // 2)
        for i, m in enumerate(msgs):
            assert set(m) == {"role", "content"}
            assert m["role"] == ("user" if i % 2 == 0 else "assistant")
            assert isinstance(m["content"], str) and m["content"].strip() == m["content"] != ""
    assert n_turns == {1, 2, 3}
    assert len({json.dumps(r) for r in rows}) > 0.9 * len(rows)  # varied, not a handful repeated
    assert demo.generate_demo_conversations(50, seed=7) == demo.generate_demo_conversations(50, seed=7)
    assert demo.generate_demo_conversations(50, seed=7) != demo.generate_demo_conversations(50, seed=8)


# ----------------------------------------------------------------------------------- tokenizer
def test_tokenizer_reloads_offline_and_round_trips(tok_dir, rows, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert len(tok) == 512
    assert tok.eos_token == tok.pad_token == demo.EOT
    special = [tok.convert_tokens_to_ids(t) for t in demo.SPECIAL_TOKENS]
    assert special == [0, 1, 2]
    for text in ["What is 37 + 48?", "  two  spaces\tand tab\n\n", "naïve café 日本 🙂 Ω≈ç",
                 demo.render_chatml(rows[0]["messages"])]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    ids = tok(demo.IM_START + "user\nhi" + demo.IM_END, add_special_tokens=False)["input_ids"]
    assert ids[0] == special[1] and ids[-1] == special[2]  # specials stay whole
    # Written in the spelling transformers 4.x (serving stacks) reads as well.
    conf = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert conf["additional_special_tokens"] == [demo.IM_START, demo.IM_END]
    assert "extra_special_tokens" not in conf and conf["chat_template"] == demo.CHAT_TEMPLATE
    # Deterministic training: a rebuild gives the same vocabulary and merges.
    demo.build_demo_tokenizer(demo.demo_tokenizer_texts(rows), tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_chat_template_renders_chatml(tok_dir, rows):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    for r in rows[:50]:
        assert tok.apply_chat_template(r["messages"], tokenize=False) == demo.render_chatml(r["messages"])


def test_data_pipeline_masks_assistant_turns(tok_dir, rows):
    from transformers import AutoTokenizer

    from specjax.data import tokenize_conversation

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    for r in rows[:20]:
        ex = tokenize_conversation(tok, r["messages"], seq_length=512)
        want = "".join(m["content"] + demo.IM_END for m in r["messages"] if m["role"] == "assistant")
        assert tok.decode(ex.input_ids[ex.loss_mask.astype(bool)].tolist()) == want


# -------------------------------------------------------------------------------------- target
def test_target_folder_loads_in_transformers_and_matches_jax(tiny_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specjax.targets import load_target

    d, info = tiny_target
    assert info["steps"] == TINY["steps"] and len(info["history"]) == TINY["steps"]
    assert np.isfinite(info["final_loss"]) and info["n_params"] > 0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (d / f).is_file(), f
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 512
    assert cfg["tie_word_embeddings"] is False and cfg["rope_parameters"]["rope_theta"] == 10000.0
    tok = AutoTokenizer.from_pretrained(str(d))
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids(demo.IM_END)

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 times 8?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = np.asarray([tok(text, add_special_tokens=False)["input_ids"]], np.int32)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids).long()).logits.numpy()

    target = load_target(str(d), dtype="float32")
    got = np.asarray(target(ids, aux_layer_ids=(0,)).logits)
    assert got.shape == ref.shape == (1, ids.shape[1], 512)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


def test_short_pretraining_lowers_loss(tok_dir, rows):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    hf = demo.demo_target_hf_config(tok, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    docs = demo.tokenize_demo_documents(rows[:400], tok, 128)
    _, _, hist = demo.pretrain_demo_target(hf, docs, steps=40, seq_len=128, batch_size=8, lr=1e-2,
                                           seed=0)
    assert [h[0] for h in hist] == list(range(40))
    first, last = hist[0][1], float(np.mean([h[1] for h in hist[-5:]]))
    assert first > 5.5  # ~ln(512) at init
    assert last < first - 2.0, hist


def test_pack_documents_layout():
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    ids, seg, pos = demo.pack_documents(docs, 6, pad_id=0, seed=0)
    assert ids.shape[1] == 6 and ids.dtype == np.int32
    assert int((seg > 0).sum()) == 10 and ids.shape[0] == 2  # first fit needs only 2 rows
    for r in range(ids.shape[0]):
        for s in set(seg[r][seg[r] > 0].tolist()):
            m = seg[r] == s
            assert pos[r][m].tolist() == list(range(int(m.sum())))
            assert ids[r][m].tolist() in docs
    assert (ids[seg == 0] == 0).all()


# ------------------------------------------------------------------------------------- caching
def test_ensure_demo_assets_builds_once(tmp_path, monkeypatch):
    # The real trainer is covered above; here only the cache logic, with a stand-in trainer.
    calls = []

    def fake_build(out_dir, *, data_path, tokenizer_dir, log, **kw):
        calls.append(kw)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out_dir))
        (out_dir / "config.json").write_text(json.dumps({"hidden_size": kw["hidden"]}))
        return {"first_loss": 6.0, "final_loss": 1.0, "final_acc": 0.5, "n_params": 1, "history": []}

    monkeypatch.setattr(demo.assets, "build_demo_target", fake_build)  # the cache calls it there
    kw = dict(TINY, steps=2, seq_len=64)
    t_dir, k_dir = demo.ensure_demo_assets(tmp_path / "cache", log=None, **kw)
    assert "demo-" in t_dir and len(calls) == 1 and calls[0] == kw
    assert json.loads(open(f"{t_dir}/config.json").read())["hidden_size"] == 64
    from transformers import AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(k_dir)) == 512

    assert demo.ensure_demo_assets(tmp_path / "cache", log=None, **kw) == (t_dir, k_dir)
    assert len(calls) == 1  # reused
    other = demo.ensure_demo_assets(tmp_path / "cache", log=None, **dict(kw, seed=1))
    assert len(calls) == 2 and other[0] != t_dir  # other parameters -> another build beside it
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp left

    # CLI build -> ensure_demo_target: same cache rule at a fixed path; never overwrites a
    # foreign folder.
    flags = [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert demo.main(["build", "--out", str(tmp_path / "tgt"), *flags]) == 0
    assert len(calls) == 3 and calls[-1] == kw
    assert (tmp_path / "tgt" / "tokenizer.json").is_file() and (tmp_path / "tgt" / demo.BUILD_MARKER).is_file()
    assert demo.ensure_demo_target(tmp_path / "tgt", log=None, **kw) == str(tmp_path / "tgt")
    assert len(calls) == 3
    demo.ensure_demo_target(tmp_path / "tgt", log=None, **dict(kw, steps=3))  # stale build of ours
    assert len(calls) == 4 and json.loads((tmp_path / "tgt" / demo.BUILD_MARKER).read_text())["params"]["target"]["steps"] == 3
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        demo.ensure_demo_target(tmp_path / "mine", log=None, **kw)
    assert (tmp_path / "mine" / "config.json").read_text() == "{}"

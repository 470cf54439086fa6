"""Training without the target's forward: `python -m specjax.precompute` writes the tiny target's states,
and a run with target.source=cache trains from them.

Bars (CPU):
  - the loss and every gradient of the cache-fed step equal the online step's on the same rows: fp32
    target, fp32 cache, 1e-5 relative (EAGLE-3 and DFlash); a bf16 target with a bf16 cache: the
    states are the bf16 values themselves, so the same bar holds (bf16 step arithmetic on both sides);
  - the cache-fed run loads only the target's embedding and lm_head;
  - a precompute that dies after two batches, rerun, writes every row once (none twice, none lost), and
    its store equals an uninterrupted precompute's;
  - a cache written for other data or taps is refused by precompute's rerun and by training, naming
    the field; an unfinished cache is refused by training;
  - a top-k teacher cache with k = the draft vocab gives the online loss and gradients (1e-5; EAGLE-3
    with the LK loss, which reads the stored full-vocab logsumexp, and DFlash), stores exactly the top k
    of the online teacher, and trains; with k < Vd the soft CE moves by at most the bound of
    docs/training.md (m * max(-log q), per position, checked with a 1e-6 slack) and the teacher's
    change in L1 is exactly 2m (1e-5); a run with another draft vocabulary is refused naming the fix;
  - a cache-fed run learns (held-out loss falls) and, stopped and resumed, matches an uninterrupted
    cache-fed run at every step (1e-6), the data position included;
  - an FP8 cache's training rows reach the devices as stored and are dequantized there to exactly (bit
    for bit) the host decoder's numbers, in float32 and in bf16.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import load_config
from specjax.data.state_cache import CacheSplit, StateCache
from specjax.train.metrics import read_metrics

DFLASH = ("draft.type=dflash", "draft.block_size=4", "train.dflash_anchors=16")


def _cfg(target, out, cache, *extra):
    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}", f"target.cache_dir={cache}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=120",
        "data.seq_length=128", "data.batch_size=8", "data.val_fraction=0.05",
        "draft.ttt_steps=3", "draft.draft_vocab_size=128", "precompute.dtype=float32", "precompute.rows_per_shard=8",
        "optim.lr=3e-3", "optim.warmup_ratio=0.1", "train.log_every=1", "train.eval_batches=1",
        "train.progress=false", "checkpoint.every_steps=4", *extra,
    ])


@pytest.fixture(scope="module")
def cache_dir(tiny_target, tmp_path_factory):
    from specjax.precompute import precompute

    out = tmp_path_factory.mktemp("cache") / "states"
    precompute(_cfg(tiny_target, tmp_path_factory.mktemp("unused"), out), progress=False)
    return str(out)


def _batch(split: CacheSplit, rows, with_states: bool):
    got = [split.read(i) for i in rows]
    keys = ["input_ids", "loss_mask", "segment_ids", "positions"]
    keys += list(split.state_keys) if with_states else []
    return {k: jnp.asarray(np.stack([g[k] for g in got])) for k in keys}


def _loss_and_grads(cfg, target, batch, vocab=None):
    from specjax.drafts.families import family_for_type
    from specjax.drafts.vocab import DraftVocab
    from specjax.train.setup import make_draft_config, make_objective_config, resolve_aux_ids
    from specjax.train.step import make_loss_fn

    draft_cfg = make_draft_config(cfg, target, resolve_aux_ids(cfg, target))
    family = family_for_type(cfg.draft.type)
    params = family.init_params(draft_cfg, jax.random.key(0))
    V = target.config.vocab_size
    vocab = vocab or DraftVocab.from_ids(np.arange(cfg.draft.draft_vocab_size), V)
    arrays = {"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
              "d2t": jnp.asarray(vocab.d2t, jnp.int32)}
    compute = jnp.float32 if cfg.target.dtype == "float32" else jnp.bfloat16
    loss_fn = make_loss_fn(target, draft_cfg, make_objective_config(cfg, draft_cfg), compute)
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, target.params, arrays, batch,
                                                                          jnp.int32(3))
    return float(loss), grads


@pytest.mark.parametrize("draft", ["eagle3", "dflash"])
def test_cache_fed_loss_and_gradients_equal_the_online_step(tiny_target, tmp_path, draft):
    from specjax.precompute import precompute
    from specjax.targets.loading import load_target

    extra = DFLASH if draft == "dflash" else ()
    cfg = _cfg(tiny_target, tmp_path / "run", tmp_path / "states", *extra)
    precompute(cfg, progress=False)
    split = StateCache.open(str(tmp_path / "states")).split("train")
    rows = [0, 3, 5, 7]
    full = load_target(tiny_target, dtype="float32")
    partial = load_target(tiny_target, dtype="float32", embedding_and_head_only=True)
    assert len(jax.tree.leaves(partial.params)) < len(jax.tree.leaves(full.params))
    online_loss, online_grads = _loss_and_grads(cfg, full, _batch(split, rows, False))
    cached_loss, cached_grads = _loss_and_grads(cfg, partial, _batch(split, rows, True))
    assert np.isfinite(online_loss) and online_loss > 0
    np.testing.assert_allclose(cached_loss, online_loss, rtol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(online_grads):
        b = dict(jax.tree_util.tree_leaves_with_path(cached_grads))[path]
        scale = float(np.abs(np.asarray(a)).max()) + 1e-12
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= 1e-5 * scale, jax.tree_util.keystr(path)


def test_bf16_cache_of_a_bf16_target_gives_the_online_loss(tiny_target, tmp_path):
    from specjax.precompute import precompute
    from specjax.targets.loading import load_target

    cfg = _cfg(tiny_target, tmp_path / "run", tmp_path / "states", "target.dtype=bfloat16", "precompute.dtype=bfloat16")
    precompute(cfg, progress=False)
    split = StateCache.open(str(tmp_path / "states")).split("train")
    full = load_target(tiny_target, dtype="bfloat16")
    partial = load_target(tiny_target, dtype="bfloat16", embedding_and_head_only=True)
    rows = [1, 2]
    online = _batch(split, rows, False)
    cached = _batch(split, rows, True)
    # the stored states are the bf16 forward's values: read back, they equal a fresh forward exactly
    final, aux = jax.jit(lambda p, b: full.forward(p, b["input_ids"], aux_layer_ids=(1, 2, 3),
                                                   positions=b["positions"], segment_ids=b["segment_ids"]))(
        full.params, online)
    np.testing.assert_array_equal(np.asarray(cached["final_hidden"]), np.asarray(final, np.float32))
    np.testing.assert_array_equal(np.asarray(cached["aux_hidden"]), np.asarray(jnp.stack(aux, 2), np.float32))
    cached = {**cached, "final_hidden": cached["final_hidden"].astype(jnp.bfloat16),
              "aux_hidden": cached["aux_hidden"].astype(jnp.bfloat16)}
    online_loss, _ = _loss_and_grads(cfg, full, online)
    cached_loss, _ = _loss_and_grads(cfg, partial, cached)
    np.testing.assert_allclose(cached_loss, online_loss, rtol=1e-5)


def test_a_killed_precompute_resumes_without_a_row_twice(tiny_target, tmp_path, cache_dir, monkeypatch):
    from specjax.precompute import precompute

    cfg = _cfg(tiny_target, tmp_path / "run", tmp_path / "states")
    written = []
    real_write = CacheSplit.write

    def write(self, rows, *a, **k):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        real_write(self, rows, *a, **k)
        written.append((self.folder.rsplit("/", 1)[-1], list(map(int, rows))))

    monkeypatch.setattr(CacheSplit, "write", write)
    with pytest.raises(KeyboardInterrupt):
        precompute(cfg, progress=False)
    assert len(written) == 2
    monkeypatch.setattr(CacheSplit, "write", lambda self, rows, *a, **k: (
        real_write(self, rows, *a, **k), written.append((self.folder.rsplit("/", 1)[-1], list(map(int, rows))))))
    precompute(cfg, progress=False)
    ref = StateCache.open(cache_dir)
    got = StateCache.open(str(tmp_path / "states"))
    for split in ("train", "val"):
        rows = [r for s, rs in written if s == split for r in rs]
        assert sorted(rows) == list(range(ref.rows(split))), split  # every row once
        for i in range(ref.rows(split)):
            a, b = ref.split(split).read(i), got.split(split).read(i)
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    assert got.complete()


def test_mismatched_and_unfinished_caches_are_refused(tiny_target, tmp_path, cache_dir):
    from specjax.precompute import precompute
    from specjax.train.loop import train

    with pytest.raises(ValueError, match=r"train_examples: the cache has"):
        precompute(_cfg(tiny_target, tmp_path / "r0", cache_dir, "data.max_rows=100"), progress=False)
    with pytest.raises(ValueError, match=r"(?s)aux_layer_ids: the cache has \[1, 2, 3\], this run has \[0, 2, 3\]"
                                         r".*python -m specjax.precompute"):
        train(_cfg(tiny_target, tmp_path / "r1", cache_dir, "target.source=cache", "target.aux_layer_ids=[0,2,3]",
                   "train.steps=2"))
    unfinished = StateCache.create(str(tmp_path / "u"), StateCache.open(cache_dir).fields,
                                   StateCache.open(cache_dir).manifest["splits"], seq_length=128, num_aux=3,
                                   hidden=64, dtype="float32")
    assert not unfinished.complete()
    with pytest.raises(ValueError, match="unfinished: .* train rows are not written"):
        train(_cfg(tiny_target, tmp_path / "r2", tmp_path / "u", "target.source=cache", "train.steps=2"))
    with pytest.raises(ValueError, match="decode_eval.backend=jax decodes with the target"):
        train(_cfg(tiny_target, tmp_path / "r3", cache_dir, "target.source=cache", "decode_eval.at_end=true"))


def test_a_cache_fed_run_learns_and_resumes_exactly(tiny_target, tmp_path, cache_dir):
    from specjax.train.loop import train

    full, split = tmp_path / "full", tmp_path / "split"
    src = ("target.source=cache", "export.at_end=false")
    res = train(_cfg(tiny_target, full, cache_dir, *src, "train.steps=12", "train.eval_every=12"))
    assert res.final_step == 12
    val = read_metrics(str(full), "val")
    assert val[-1]["loss"] < val[0]["loss"] - 0.05, val
    first = train(_cfg(tiny_target, split, cache_dir, *src, "train.steps=12", "train.eval_every=12",
                       "train.stop_at_step=6"))
    assert first.stopped_early and first.final_step == 6
    train(_cfg(tiny_target, split, cache_dir, *src, "train.steps=12", "train.eval_every=12"))
    a = {r["step"]: r for r in read_metrics(str(full), "train")}
    b = {r["step"]: r for r in read_metrics(str(split), "train")}
    assert sorted(b) == list(range(1, 13))
    for step in range(1, 13):
        for key in ("loss", "acc_0", "grad_norm"):
            np.testing.assert_allclose(b[step][key], a[step][key], rtol=1e-6, atol=1e-7, err_msg=f"{key} @ {step}")


def test_compile_only_lowers_the_cache_fed_step(tiny_target, tmp_path):
    """--compile-only with target.source=cache compiles the step a cache-fed run runs: the target's
    embedding and lm_head as arguments, the states in the batch, no target forward."""
    from specjax.train.aot import compile_step, lower_train_step
    from specjax.train.setup import make_mesh

    cfg = _cfg(tiny_target, tmp_path / "b", tmp_path / "c", "target.source=cache")
    step = lower_train_step(cfg, make_mesh(cfg))
    batch = step.abstract_args[3]
    assert set(batch) == {"input_ids", "loss_mask", "segment_ids", "positions", "final_hidden", "aux_hidden"}
    D = step.target.config.hidden_size
    assert batch["aux_hidden"].shape == (8, 128, 3, D) and batch["final_hidden"].shape == (8, 128, D)
    assert len(jax.tree.leaves(step.abstract_args[1])) == 2  # embedding, lm_head
    topk = lower_train_step(_cfg(tiny_target, tmp_path / "b", tmp_path / "c", "target.source=cache",
                                 "precompute.teacher_top_k=16"), make_mesh(cfg)).abstract_args[3]
    assert set(topk) == set(batch) - {"final_hidden"} | {"teacher_ids", "teacher_logits", "target_argmax", "target_lse"}
    assert topk["teacher_ids"].shape == topk["teacher_logits"].shape == (8, 128, 16)
    online = compile_step(_cfg(tiny_target, tmp_path / "a", tmp_path / "c"))
    cached = compile_step(cfg)
    assert cached["target_param_bytes_per_device"] < online["target_param_bytes_per_device"]
    assert cached["flops_per_step"] < online["flops_per_step"]


@pytest.mark.parametrize("draft", ["eagle3", "dflash"])
def test_top_k_teacher_cache_equals_the_online_step_and_trains(tiny_target, tmp_path, draft):
    from specjax.drafts.vocab import DraftVocab
    from specjax.drafts.ttt import teacher_from_hidden
    from specjax.precompute import precompute
    from specjax.targets.loading import load_target
    from specjax.train.cache_source import check_cache_vocab
    from specjax.train.loop import train

    extra = DFLASH if draft == "dflash" else ("train.loss=lk_lambda",)
    cfg = _cfg(tiny_target, tmp_path / "run", tmp_path / "states", "precompute.teacher_top_k=128", *extra)
    precompute(cfg, progress=False)
    cache = StateCache.open(str(tmp_path / "states"))
    assert cache.teacher_top_k == 128
    vocab = DraftVocab.load(str(tmp_path / "states" / "draft_vocab.npz"))
    split = cache.split("train")
    rows = [0, 3, 5, 7]
    full = load_target(tiny_target, dtype="float32")
    partial = load_target(tiny_target, dtype="float32", embedding_and_head_only=True)
    online, cached = _batch(split, rows, False), _batch(split, rows, True)
    assert "final_hidden" not in cached and cached["teacher_ids"].shape == (4, 128, 128)
    # the store holds the online teacher's top k (here all of it, largest first), argmax and logsumexp
    final, _ = full.forward(full.params, online["input_ids"], aux_layer_ids=(1, 2, 3), positions=online["positions"],
                            segment_ids=online["segment_ids"])
    logits, argmax, lse = teacher_from_hidden(final, full.lm_head_weight(full.params), jnp.asarray(vocab.draft_ids),
                                              8192, with_lse=True)
    values, ids = jax.lax.top_k(logits, 128)
    np.testing.assert_array_equal(np.asarray(cached["teacher_ids"]), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(cached["teacher_logits"]), np.asarray(values), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cached["target_argmax"]), np.asarray(argmax))
    np.testing.assert_allclose(np.asarray(cached["target_lse"]), np.asarray(lse), rtol=1e-6)

    online_loss, online_grads = _loss_and_grads(cfg, full, online, vocab)
    cached_loss, cached_grads = _loss_and_grads(cfg, partial, cached, vocab)
    np.testing.assert_allclose(cached_loss, online_loss, rtol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(online_grads):
        b = dict(jax.tree_util.tree_leaves_with_path(cached_grads))[path]
        scale = float(np.abs(np.asarray(a)).max()) + 1e-12
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= 1e-5 * scale, jax.tree_util.keystr(path)
    if draft == "dflash":
        return
    with pytest.raises(ValueError, match=r"another draft vocabulary.*draft\.vocab_file=.*draft_vocab\.npz"):
        check_cache_vocab(cfg, DraftVocab.from_ids(np.arange(128), full.config.vocab_size))
    res = train(_cfg(tiny_target, tmp_path / "run", tmp_path / "states", "precompute.teacher_top_k=128", *extra,
                     "target.source=cache", "export.at_end=false", "train.steps=2", "train.eval_every=2"))
    assert res.final_step == 2
    assert all(np.isfinite(r["loss"]) for r in read_metrics(str(tmp_path / "run"), "train"))


def test_top_k_teacher_bound(tiny_target):
    """docs/training.md's bound, per position: the tiny target's real draft-vocab teacher p, its top-8
    teacher p_k as the step rebuilds it (dense_logits), random draft distributions q."""
    from specjax.drafts.teacher import dense_logits, tail_mass, top_k_of
    from specjax.drafts.ttt import teacher_from_hidden
    from specjax.targets.loading import load_target

    target = load_target(tiny_target, dtype="float32")
    ids = jax.random.randint(jax.random.key(1), (2, 64), 0, target.config.vocab_size)
    final, _ = target.forward(target.params, ids, aux_layer_ids=(1,))
    draft_ids = jnp.arange(0, target.config.vocab_size, 2)  # 160 draft tokens
    logits, argmax, lse = teacher_from_hidden(final, target.lm_head_weight(target.params), draft_ids, 8192,
                                              with_lse=True)
    k = 8
    p = jax.nn.softmax(logits, axis=-1)
    p_k = jax.nn.softmax(dense_logits(top_k_of(logits, argmax, lse, k), draft_ids.shape[0]), axis=-1)
    m = tail_mass(logits, k)
    assert float(m.min()) > 1e-3  # the bound is exercised, not vacuous
    np.testing.assert_allclose(np.asarray(jnp.abs(p - p_k).sum(-1)), np.asarray(2 * m), rtol=1e-5, atol=1e-6)
    for seed in range(3):
        log_q = jax.nn.log_softmax(3 * jax.random.normal(jax.random.key(seed), logits.shape), axis=-1)
        diff = jnp.abs(-(p * log_q).sum(-1) + (p_k * log_q).sum(-1))
        bound = m * jnp.max(-log_q, axis=-1)
        assert bool(jnp.all(diff <= bound + 1e-6)), float(jnp.max(diff - bound))
        assert float(jnp.max(diff / bound)) > 0.05  # and not loose by orders of magnitude


def test_each_process_reads_only_its_rows_of_the_global_batch(cache_dir, monkeypatch):
    """With 2 processes each host's cache iterator reads only its half of each global batch (rows counted
    at the store), the halves together are the 1-process batch, and get_state / set_state resume both."""
    from specjax.train.cache_source import HostRows, make_cache_iterator

    cache = StateCache.open(cache_dir)
    read = []
    real = CacheSplit.read_rows
    monkeypatch.setattr(CacheSplit, "read_rows",
                        lambda self, rows, *a, **kw: (read.append(len(rows)), real(self, rows, *a, **kw))[1])
    one = make_cache_iterator(cache, 8, 3, np.float32)
    hosts = [make_cache_iterator(cache, 8, 3, np.float32, p, 2) for p in (0, 1)]
    for _ in range(3):
        whole = next(one)
        halves = [next(h) for h in hosts]
        assert all(isinstance(b, HostRows) and b["input_ids"].shape[0] == 4 for b in halves)
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), whole[k])
    assert set(read) == {8, 4}  # a host reads 4 rows a batch (prefetching ahead), the single process 8
    state = hosts[1].get_state()
    want = next(hosts[1])
    again = make_cache_iterator(cache, 8, 3, np.float32, 1, 2)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["input_ids"], want["input_ids"])


def test_fp8_cache_rows_are_dequantized_on_the_device_to_the_host_decoders_numbers(tiny_target, tmp_path):
    """An FP8 cache's training rows leave the host as stored (float8 values, float32 per-token scales)
    and the loop's placement dequantizes them on the devices: bit for bit the numbers the host decoder
    (CacheSplit.read) gives, in the run's state dtype, on the batch sharding; a cache-fed run trains.
    precompute.rows_per_shard=0 gives a shard per write (data.batch_size rows)."""
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax.data.state_cache import dequantize_per_token
    from specjax.precompute import precompute
    from specjax.train.cache_source import HostRows, make_cache_iterator
    from specjax.train.loop import global_batch, train
    from specjax.train.step import cached_batch_keys

    fp8 = ("precompute.dtype=float8_e4m3fn", "precompute.rows_per_shard=0", "train.steps=3", "export.at_end=false")
    precompute(_cfg(tiny_target, tmp_path / "unused", tmp_path / "states", *fp8), progress=False)
    cache = StateCache.open(str(tmp_path / "states"))
    assert cache.manifest["rows_per_shard"] == 8  # 0: a shard per write, data.batch_size rows
    assert cache.split("train").scale_keys == ("final_scale", "aux_scale")
    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("data",)), P("data"))
    keys = cached_batch_keys(0)
    for state_dtype in (np.float32, ml_dtypes.bfloat16):
        rows = next(make_cache_iterator(cache, 8, 3, state_dtype))
        assert isinstance(rows, HostRows) and rows["aux_hidden"].dtype == ml_dtypes.float8_e4m3fn
        placed = global_batch(rows, sharding, keys)
        assert set(placed) == set(keys)  # the scales are spent on the device
        for name in ("final_hidden", "aux_hidden"):
            host = dequantize_per_token(rows[name], rows[name.replace("hidden", "scale")]).astype(state_dtype)
            got = np.asarray(placed[name])
            assert got.dtype == np.dtype(state_dtype) and placed[name].sharding.is_equivalent_to(sharding, got.ndim)
            bits = np.uint32 if state_dtype is np.float32 else np.uint16
            np.testing.assert_array_equal(got.view(bits), host.view(bits), err_msg=name)
            assert np.abs(host.astype(np.float32)).max() > 0.1  # states, not zeros
    res = train(_cfg(tiny_target, tmp_path / "run", tmp_path / "states", *fp8, "target.source=cache"))
    assert res.final_step == 3 and np.isfinite(res.last_metrics["loss"])

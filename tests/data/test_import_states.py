"""python -m specjax.import_states: a speculators / hs-connectors dump as a state cache.

The dump is built here the way speculators lays one out (a save_to_disk dataset folder with
input_ids / loss_mask, hs_<i>.safetensors in its hidden_states/), its files written with
safetensors and hs-connectors' own quantize_tensor_to_fp8 from the tiny JAX target's states (one
packed forward, fp32): vLLM ids = the taps + 1, then num_layers (the last layer before the final
norm). Bars (cache stored in float32, so only the dump's own rounding is measured):
  - bf16 files: the taps equal the JAX taps rounded to bf16 exactly; the final hidden (the target's
    final norm of the bf16 last state) is within 2^-7 relative of the JAX final hidden (a bf16
    rounding, 2^-8, of each input and of their RMS, carried through the norm);
  - FP8 files: every tap within half an e4m3 step of its value in the file's per-token scale
    (2^-4 relative for normals, 2^-10 x scale in the subnormal range);
  - a file whose token ids are not its row's input ids is refused, naming the row;
  - training's manifest check accepts the imported cache (FOREIGN_CHECKED) and refuses other taps;
    its examples read back from the rows are the dump's (as a multiset: they come in row order), and
    a run with no data files of its own trains from it.
"""
import json

import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest
import torch
from safetensors.torch import save_file

from specjax.config import load_config

T = 128


def _cfg(target, cache, *extra):
    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"target.cache_dir={cache}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=24", f"data.seq_length={T}",
        "data.batch_size=8", "data.val_fraction=0.1", "precompute.dtype=float32", "precompute.rows_per_shard=4",
        "draft.draft_vocab_size=128",
        *extra])


@pytest.fixture(scope="module")
def dump(tiny_target, tmp_path_factory):
    """(examples, per-example JAX taps [n, A, D], last pre-norm [n, D], final [n, D], dump folder)."""
    import jax
    import jax.numpy as jnp

    from specjax.targets.loading import load_target
    from specjax.train.cache_source import packed_rows
    from specjax.train.run import prepare_training_examples
    from specjax.train.setup import build_tokenizer
    from specjax.data.pipeline import first_fit_rows

    root = tmp_path_factory.mktemp("dump")
    cfg = _cfg(tiny_target, root / "unused", "data.val_fraction=0")
    examples = prepare_training_examples(cfg, build_tokenizer(cfg), str(root / "prep")).train
    target = load_target(tiny_target, dtype="float32")
    L = target.num_layers
    taps = tuple(target.default_aux_layer_ids())
    ids = tuple(sorted(set(taps) | {L - 1}))  # output-of-layer ids of what vLLM would give: taps and the last
    rows = packed_rows(examples, T)
    batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
    final, aux = jax.jit(lambda p, b: target.forward(p, b["input_ids"], aux_layer_ids=ids, positions=b["positions"],
                                                     segment_ids=b["segment_ids"]))(target.params, batch)
    final, aux = np.asarray(final), np.stack([np.asarray(a) for a in aux], axis=2)  # [R, T, len(ids), D]
    per = []
    for r, row in enumerate(first_fit_rows(examples, T)):
        at = 0
        for i in row:
            n = len(examples[i].input_ids)
            per.append((i, aux[r, at:at + n], final[r, at:at + n]))
            at += n
    per.sort(key=lambda x: x[0])
    states = [p[1] for p in per]  # [n, len(ids), D] each, vLLM order (ascending)
    finals = [p[2] for p in per]
    folder = root / "speculators"
    folder.mkdir()
    table = pa.table({"input_ids": [ex.input_ids.astype(np.int64).tolist() for ex in examples],
                      "loss_mask": [ex.loss_mask.astype(np.int64).tolist() for ex in examples],
                      "seq_len": [len(ex.input_ids) for ex in examples]})
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return {"examples": examples, "states": states, "finals": finals, "folder": folder, "taps": taps, "ids": ids}


def _write_files(d, fmt: str):
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    hs = d["folder"] / "hidden_states"
    hs.mkdir(exist_ok=True)
    scales = []
    for i, (ex, st) in enumerate(zip(d["examples"], d["states"])):
        t = torch.from_numpy(np.ascontiguousarray(st)).to(torch.bfloat16 if fmt == "bf16" else torch.float32)
        tensors = {"token_ids": torch.from_numpy(ex.input_ids.astype(np.int64))}
        if fmt == "fp8":
            values, scale = quantize_tensor_to_fp8(t)
            tensors.update(hidden_states=values, **{SCALES_KEY: scale})
            scales.append(scale.numpy().reshape(-1))
        else:
            tensors["hidden_states"] = t
        save_file(tensors, str(hs / f"hs_{i}.safetensors"))
    return scales


def _read_back(cache, examples, n_train):
    """Per example, in dump order: (taps [n, A, D], final [n, D]) from the cache's rows (each split
    first-fit packed in order: a row's segment k is its k-th example of first_fit_rows)."""
    from specjax.data.pipeline import first_fit_rows

    out = {}
    for split, first, exs in (("train", 0, examples[:n_train]), ("val", n_train, examples[n_train:])):
        if not exs:
            continue
        s = cache.split(split)
        for r, members in enumerate(first_fit_rows(exs, T)):
            row = s.read(r)
            for seg, i in enumerate(members, start=1):
                at = row["segment_ids"] == seg
                out[first + i] = (row["aux_hidden"][at], row["final_hidden"][at])
    return [out[i] for i in range(len(examples))]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_imported_states_equal_the_jax_targets(dump, tiny_target, tmp_path, fmt):
    from specjax.data.state_cache import StateCache
    from specjax.import_states import import_dump
    from specjax.train.cache_source import (cache_origin, examples_from_cache, foreign_cache_fields,
                                            open_checked_cache)

    scales = _write_files(dump, fmt)
    cfg = _cfg(tiny_target, tmp_path / "cache")
    import_dump(cfg, str(dump["folder"]), progress=False)
    cache = StateCache.open(str(tmp_path / "cache"))
    n = len(dump["examples"])
    n_val = int(n * 0.1)
    assert cache.complete() and n_val > 0 and cache.rows("val") > 0
    got = _read_back(cache, dump["examples"], n - n_val)
    assert len(got) == n
    tap_at = [dump["ids"].index(k) for k in dump["taps"]]
    for i, ((aux, final), want, want_final) in enumerate(zip(got, dump["states"], dump["finals"])):
        want_aux = want[:, tap_at]
        if fmt == "bf16":
            np.testing.assert_array_equal(aux, want_aux.astype(ml_dtypes.bfloat16).astype(np.float32))
            assert np.all(np.abs(final - want_final) <= 2**-7 * np.abs(want_final) + 1e-6), i
        else:
            s = scales[i][:, None, None]
            tol = np.maximum(2**-4 * np.abs(want_aux), 2**-10 * s)
            assert np.all(np.abs(aux - want_aux) <= tol), i

    # training's check: the imported cache passes on FOREIGN_CHECKED; other taps are refused by name
    origin = cache_origin(cfg)
    assert origin.startswith("hs-connectors:")
    open_checked_cache(cfg, foreign_cache_fields(cfg, list(dump["taps"]), origin))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        open_checked_cache(cfg, foreign_cache_fields(cfg, [0, 1, 2], origin))
    back = examples_from_cache(cache)  # in row order: the same examples, packed order

    def key(ex):
        return tuple(ex.input_ids.tolist()), tuple(ex.loss_mask.tolist())

    assert sorted(map(key, back.train + back.val)) == sorted(map(key, dump["examples"]))
    if fmt == "bf16":  # a run trains from it with no data files of its own
        from specjax.train.loop import train
        from specjax.train.metrics import read_metrics

        run = tmp_path / "run"
        res = train(_cfg(tiny_target, tmp_path / "cache", "target.source=cache", "data.train_files=[]",
                         f"run.output_dir={run}", "train.steps=2", "train.log_every=1", "train.eval_every=2",
                         "train.eval_batches=1", "train.progress=false", "export.at_end=false",
                         "checkpoint.every_steps=100"))
        assert res.final_step == 2 and all(np.isfinite(r["loss"]) for r in read_metrics(str(run), "train"))


def test_a_file_with_other_tokens_is_refused_naming_the_row(dump, tiny_target, tmp_path):
    from safetensors.torch import load_file

    from specjax.import_states import import_dump

    _write_files(dump, "bf16")
    path = dump["folder"] / "hidden_states" / "hs_3.safetensors"
    t = load_file(str(path))
    t["token_ids"] = t["token_ids"].clone()
    t["token_ids"][5] += 1
    save_file(t, str(path))
    with pytest.raises(ValueError, match=r"hs_3\.safetensors: its token_ids are not dataset row 3's input_ids "
                                         r"\(first difference at position 5"):
        import_dump(_cfg(tiny_target, tmp_path / "cache"), str(dump["folder"]), progress=False)

"""specjax.data.state_cache: the offline store of a target's states.

FP8 per-token scales: the stored e4m3 bytes decoded by an independent NumPy decoder (sign, 4-bit
exponent with bias 7, 3-bit mantissa, subnormals; written here from the OCP FP8 definition) times
the stored scale equal `dequantize_per_token` exactly, and the round trip is within half an e4m3 ulp
of each value (relative 2^-4 for normals, 2^-10 x scale absolute in the subnormal range). bf16 and
fp32 stores give back exactly what was written. Rows written out of order and in several calls read
back row by row; `done` marks exactly the rows written; a manifest difference names its field."""
import json

import ml_dtypes
import numpy as np
import pytest

from specjax.data.state_cache import (FP8_MAX, TEACHER_ARRAYS, StateCache, dequantize_per_token,
                                      manifest_differences, quantize_per_token, state_bytes_per_token)
from specjax.drafts.teacher import TOPK_STATE_KEYS


def _decode_e4m3(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64 (no infinities; 0x7f / 0xff are NaN)."""
    b = bits.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = sign * (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = sign * (man / 8.0) * np.exp2(-6.0)
    out = np.where(exp == 0, sub, normal)
    return np.where((b & 0x7F) == 0x7F, np.nan, out)


def test_fp8_per_token_against_a_numpy_decoder():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 64)) * np.exp(rng.normal(size=(3, 5, 1)) * 3)  # scales over many decades
    x[0, 0] = 0.0  # an all-zero token: scale 1
    x[1, 1, :8] = 1e-9  # tiny values beside a large one: the subnormal range
    values, scale = quantize_per_token(x)
    assert values.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32 and scale.shape == (3, 5)
    assert scale[0, 0] == 1.0
    decoded = _decode_e4m3(values.view(np.uint8)) * scale[..., None].astype(np.float64)
    got = dequantize_per_token(values, scale)
    np.testing.assert_array_equal(got, decoded.astype(np.float32))
    assert np.abs(values.astype(np.float32)).max() <= FP8_MAX
    err = np.abs(got.astype(np.float64) - x)
    bound = np.maximum(np.abs(x) * 2.0**-4, scale[..., None] * 2.0**-10) * (1 + 1e-6)
    assert np.all(err <= bound), float((err / bound).max())


def test_bytes_per_token():
    assert state_bytes_per_token(3, 128, "bfloat16") == 4 * 128 * 2 + 4 + 1 + 4 + 4
    assert state_bytes_per_token(3, 128, "float8_e4m3fn") == 4 * (128 + 4) + 13
    assert state_bytes_per_token(1, 16, "float32") == 2 * 64 + 13
    # a top-k teacher in place of the final hidden: k int32 ids + k float32 logits + argmax + lse
    assert state_bytes_per_token(3, 128, "bfloat16", teacher_top_k=8) == 3 * 128 * 2 + 8 * 8 + 8 + 13


def test_top_k_teacher_rows_round_trip_exactly(tmp_path):
    """A top-k cache stores no final hidden; its teacher arrays come back exactly (float32 logits even
    in a bf16 / FP8 store), under the names the step's batch uses."""
    assert tuple(TEACHER_ARRAYS) == TOPK_STATE_KEYS
    N, T, A, D, k = 4, 5, 2, 8, 3
    rng = np.random.default_rng(2)
    tokens = {"input_ids": rng.integers(0, 300, (N, T)), "loss_mask": rng.integers(0, 2, (N, T)),
              "segment_ids": rng.integers(0, 3, (N, T)), "positions": np.tile(np.arange(T), (N, 1))}
    aux = rng.normal(size=(N, T, A, D)).astype(np.float32)
    teacher = {"teacher_ids": rng.integers(0, 100, (N, T, k)), "teacher_logits": rng.normal(size=(N, T, k)) * 7,
               "target_argmax": rng.integers(0, 300, (N, T)), "target_lse": rng.normal(size=(N, T)) + 9}
    teacher = {name: v.astype(TEACHER_ARRAYS[name]) for name, v in teacher.items()}
    cache = StateCache.create(str(tmp_path / "c"), {}, {"train": N}, seq_length=T, num_aux=A, hidden=D,
                              dtype="float8_e4m3fn", teacher_top_k=k)
    split = cache.split("train")
    with pytest.raises(ValueError, match="holds a top-k teacher"):
        split.write(np.arange(N), tokens, aux[:, :, 0], aux)
    split.write(np.arange(N), tokens, None, aux, teacher)
    reopened = StateCache.open(str(tmp_path / "c"))
    assert reopened.teacher_top_k == k and not (tmp_path / "c" / "train" / "final_hidden").exists()
    for i in range(N):
        row = reopened.split("train").read(i)
        assert "final_hidden" not in row
        for name, v in teacher.items():
            assert row[name].dtype == v.dtype
            np.testing.assert_array_equal(row[name], v[i])
        np.testing.assert_array_equal(row["aux_hidden"], dequantize_per_token(*quantize_per_token(aux[i])))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_rows_round_trip(tmp_path, dtype):
    N, T, A, D = 7, 6, 3, 16
    rng = np.random.default_rng(1)
    tokens = {"input_ids": rng.integers(0, 300, (N, T)), "loss_mask": rng.integers(0, 2, (N, T)),
              "segment_ids": rng.integers(0, 3, (N, T)), "positions": np.tile(np.arange(T), (N, 1))}
    final = rng.normal(size=(N, T, D)).astype(np.float32)
    aux = rng.normal(size=(N, T, A, D)).astype(np.float32)
    cache = StateCache.create(str(tmp_path / "c"), {"a": 1}, {"train": N, "val": 0}, seq_length=T, num_aux=A,
                              hidden=D, dtype=dtype, rows_per_shard=3)
    split = cache.split("train")
    assert not split.done().any()
    for rows in ([5, 0], [3], [6, 1, 2]):  # out of order, several calls, across shards of 3 rows
        rows = np.asarray(rows)
        split.write(rows, {k: v[rows] for k, v in tokens.items()}, final[rows], aux[rows])
    assert split.done().tolist() == [True, True, True, True, False, True, True]
    reopened = StateCache.open(str(tmp_path / "c")).split("train")
    for i in (0, 1, 2, 3, 5, 6):
        row = reopened.read(i)
        for k in tokens:
            np.testing.assert_array_equal(row[k], tokens[k][i])
        if dtype == "float8_e4m3fn":
            for name, ref in (("final_hidden", final[i]), ("aux_hidden", aux[i])):
                np.testing.assert_array_equal(row[name], dequantize_per_token(*quantize_per_token(ref)))
        else:
            cast = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
            np.testing.assert_array_equal(row["final_hidden"], final[i].astype(cast).astype(np.float32))
            np.testing.assert_array_equal(row["aux_hidden"], aux[i].astype(cast).astype(np.float32))
    with pytest.raises(KeyError, match="no 'val' rows"):
        cache.split("val")
    with pytest.raises(FileExistsError, match="already holds a state cache"):
        StateCache.create(str(tmp_path / "c"), {}, {"train": 1}, seq_length=T, num_aux=A, hidden=D, dtype=dtype)


def test_open_errors_and_manifest_differences(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m specjax.precompute"):
        StateCache.open(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a specjax-state-cache"):
        StateCache.open(str(tmp_path))
    diffs = manifest_differences({"aux_layer_ids": [1, 2], "target": "a", "only_here": 1},
                                 {"aux_layer_ids": [1, 3], "target": "a"})
    assert diffs == ["aux_layer_ids: the cache has [1, 2], this run has [1, 3]",
                     "only_here: the cache has 1, this run has \"<absent>\""]
    with pytest.raises(ValueError, match="dtype 'int8' is not one of"):
        StateCache.create(str(tmp_path / "x"), {}, {"train": 1}, seq_length=2, num_aux=1, hidden=2, dtype="int8")

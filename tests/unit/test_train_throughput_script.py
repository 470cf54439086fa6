"""benchmarks/train_throughput.py (issue 9): the MFU arithmetic against a hand count, and a CPU smoke run
of both systems (specjax's train step and SpecForge's OnlineEagle3Model) at tiny widths that must give a
finite loss that goes down over the same batches."""
import argparse
import importlib.util
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("train_throughput", os.path.join(ROOT, "benchmarks", "train_throughput.py"))
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)

# vocab 10, hidden 4, MLP 8, 2 layers, 2 query heads / 1 KV head of width 2
HF = tt.llama_hf(10, 4, 8, 2, 2, 1, 2, max_pos=64)


def test_flop_count_by_hand():
    # target matmul params per token: per layer q 4*4 + k,v 2*4*2 + o 4*4 = 48, MLP 3*4*8 = 96; 2 layers
    # -> 288, + lm_head 10*4 = 328
    assert tt.target_active_matmul_params(HF) == 328
    d = tt.draft_shape(HF, Vd=5)
    f = tt.step_flops(HF, d, K=2, doc_lengths=[4, 2])  # n = 6 tokens, causal pairs 10 + 3 = 13
    assert f["target"] == 2 * 328 * 6 + 4 * 2 * 2 * 13 * 2  # 3936 + 416 = 4352
    assert f["teacher"] == 2 * 5 * 4 * 6  # 240
    # draft layer: q,k,v from 2H = 2*4*(2+2)*2 = 64, o 16, MLP 96 -> 176 params; fc 3H*H = 48
    fwd = 2 * 48 * 6 + (2 * 176 * 6 + 240 + 16 * 13) + (2 * 176 * 6 + 240 + 16 * (13 + 6))
    assert f["draft"] == 3 * fwd == 17376
    assert f["total"] == 21968


def test_mfu_in_summary():
    # fixed job: 2 steps of 2 x 4 tokens; per step (hand count as above with n = 8, pairs = 20):
    # target 2*328*8 + 16*20*2 = 5888, teacher 320, draft 3*(768 + 3456 + 3584) = 23424 -> 29632
    job = {"name": "fixed_4", "kind": "fixed", "seq": 4, "batch": 2, "steps": 2}
    plan = {"model": "m", "hf": HF, "K": 2, "Vd": 5, "jobs": [job]}
    flops = 2 * 29632
    t = flops / tt.PEAK_FLOPS / 0.5  # a run at exactly 50% MFU
    rows = [{"system": s, "job": "fixed_4", "ok": True, "time_s": t, "step_s": t / 2,
             "losses": [2.0, 1.5, 1.2, 1.1], "plan_bytes": 2**30} for s in ("specjax", "specforge")]
    rows[1]["time_s"] = 2 * t
    line = tt.summarise(plan, rows)[0]
    assert line["specjax"]["mfu"] == pytest.approx(0.5, rel=1e-12)
    assert line["specforge"]["mfu"] == pytest.approx(0.25, rel=1e-12)
    assert line["specjax"]["tokens_per_s"] == pytest.approx(16 / t)
    assert line["ratio"] == pytest.approx(2.0)
    assert line["specjax"]["decreasing"] and line["specjax"]["finite"]


def test_sharegpt_packing_keeps_documents():
    lengths = np.array([5, 9, 17, 30, 40, 64, 12, 23])
    rows = tt.sample_packed_rows(lengths, 6, 64, seed=3)
    assert len(rows) == 6 and all(0 < sum(r) <= 64 for r in rows)
    b = tt.packed_batch(rows, 64, 50, 0)
    assert int(b["loss_mask"].sum()) == sum(map(sum, rows))
    assert [int(b["segment_ids"][i].max()) for i in range(6)] == [len(r) for r in rows]
    # the committed length table exists and is truncated at 4096
    real = tt.load_lengths()
    assert len(real) > 1000 and real.max() <= 4096 and real.min() > 0


def test_tiny_run_both_systems():
    pytest.importorskip("torch")
    pytest.importorskip("specforge")
    args = argparse.Namespace(tokens_per_step=128, steps=4, warmup=1, only_seq=None, sharegpt=False,
                              profile=False, maxlen=False, maxlen_cap_s=10, sharegpt_steps=2, worker_budget_s=1e9)
    plan = tt.build_plan("llama3_8b", True, args)
    rows = tt.run_inprocess(plan)
    (line,) = tt.summarise(plan, rows)
    for s in ("specjax", "specforge"):
        r = line[s]
        assert "error" not in r, r
        print(s, r["loss_first"], "->", r["loss_last"])
        assert r["finite"] and r["decreasing"], (s, r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1



def test_gpt_oss_flops_and_a_tiny_run_with_random_mxfp4_experts():
    """The gpt-oss shape: every layer routed (k experts of width intermediate_size), sliding layers count
    only their window's attention pairs; a tiny specjax run on random MXFP4 experts trains."""
    hf = tt.model_hf("gpt_oss_120b", tiny=False)
    H, L, E, F, V = 2880, 36, 128, 2880, 201088
    attn = H * 64 * 64 + 2 * H * 8 * 64 + 64 * 64 * H
    assert tt.target_active_matmul_params(hf) == L * (attn + 4 * 3 * H * F + H * E) + V * H
    full, slid = tt.causal_pairs([300]), tt.causal_pairs([300], 128)
    assert slid == sum(min(i + 1, 128) for i in range(300)) < full
    assert tt.target_attention_pairs(hf, [300]) == 18 * full + 18 * slid
    args = argparse.Namespace(tokens_per_step=128, steps=4, warmup=1, only_seq=None, sharegpt=False,
                              profile=False, maxlen=False, maxlen_cap_s=10, sharegpt_steps=2, worker_budget_s=1e9)
    plan = tt.build_plan("gpt_oss_120b", True, args)
    rows = tt.run_inprocess(plan, systems=("specjax:q_block=16",))
    (line,) = tt.summarise(plan, rows)
    r = line["specjax:q_block=16"]
    assert "error" not in r, r
    assert r["finite"] and r["decreasing"] and r["tokens_per_s"] > 0


def test_qwen3_5_moe_flops_and_both_systems_on_the_same_tiny_target():
    """The Qwen3.5-35B-A3B shape: Gated DeltaNet layers count their projections and no attention pairs,
    full-attention layers a query gate beside the query, the MoE a shared expert with its gate; the
    draft's width is specjax's rule for a target with no dense MLP (k * F + shared). A tiny run of both
    systems: the same random weights reach both, so the first losses agree (fp32 on the CPU) within
    2e-3 rel, the agreement the two systems' losses have on the plain Llama shape too (1.188 / 1.189:
    their reductions over TTT positions are not the same sum)."""
    hf = tt.model_hf("qwen3_5_35b_a3b", tiny=False)
    H, L, V = 2048, 40, 248320
    full = 2 * H * 16 * 256 + 2 * H * 2 * 256 + 16 * 256 * H
    linear = H * (2 * 16 * 128 + 2 * 32 * 128 + 2 * 32) + 32 * 128 * H
    moe = 8 * 3 * H * 512 + H * 256 + 3 * H * 512 + H
    assert tt.target_active_matmul_params(hf) == 30 * linear + 10 * full + L * moe + V * H
    assert tt.target_attention_pairs(hf, [300]) == 10 * tt.causal_pairs([300])
    assert tt.draft_shape(hf, 32000)["I"] == 8 * 512 + 512
    pytest.importorskip("torch")
    pytest.importorskip("specforge")
    args = argparse.Namespace(tokens_per_step=128, steps=4, warmup=1, only_seq=None, sharegpt=False,
                              profile=False, maxlen=False, maxlen_cap_s=10, sharegpt_steps=2, worker_budget_s=1e9)
    plan = tt.build_plan("qwen3_5_35b_a3b", True, args)
    rows = tt.run_inprocess(plan)
    (line,) = tt.summarise(plan, rows)
    for s in ("specjax", "specforge"):
        assert "error" not in line[s], line[s]
        assert line[s]["finite"] and line[s]["tokens_per_s"] > 0
    assert line["specjax"]["loss_first"] == pytest.approx(line["specforge"]["loss_first"], rel=2e-3)


def test_tiny_summary_shows_a_system_given_with_options(tmp_path, capsys):
    """--systems specjax:q_block=16 alone: the summary row is the measured one, under the full label
    (it used to look up the bare "specjax" and print {'error': 'not run'})."""
    res = tt.main(["--tiny", "--no-maxlen", "--no-sharegpt", "--systems", "specjax:q_block=16",
                   "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    (line,) = res["models"]["llama3_8b"]["summary"]
    assert set(line) == {"model", "job", "specjax:q_block=16"}, line  # no rows for systems not asked for
    r = line["specjax:q_block=16"]
    assert "error" not in r, r
    (row,) = [x for x in res["models"]["llama3_8b"]["rows"] if x.get("job") == "fixed_32"]
    assert row["system"] == "specjax:q_block=16"
    assert r["step_s"] == row["step_s"] and r["tokens_per_s"] == pytest.approx(4 * 128 / row["time_s"], rel=1e-12)
    assert "not run" not in printed
    (text,) = [x for x in printed.splitlines() if "fixed_32" in x]
    assert "specjax:q_block=16" in text and f"{r['tokens_per_s']:9.0f} tok/s" in text


def test_summary_ratios_of_a_variant():
    """A variant's row carries its tokens/s against SpecForge and plain specjax (exact ratios of the
    rows' times), and the printed table shows each system under its label with those ratios."""
    job = {"name": "fixed_4", "kind": "fixed", "seq": 4, "batch": 2, "steps": 2}
    plan = {"model": "m", "hf": HF, "K": 2, "Vd": 5, "jobs": [job]}
    times = {"specjax": 1.0, "specforge": 4.0, "specjax:q_block=512": 0.5}
    rows = [{"system": s, "job": "fixed_4", "ok": True, "time_s": t, "step_s": t / 2,
             "losses": [2.0, 1.5, 1.2, 1.1]} for s, t in times.items()]
    (line,) = tt.summarise(plan, rows, ["specjax:q_block=512", "specforge"])
    assert "specjax" not in line and "ratio" not in line
    assert line["ratio specjax:q_block=512 / specforge"] == pytest.approx(8.0, rel=1e-12)
    (line,) = tt.summarise(plan, rows)  # default: specjax, specforge and the variants with rows
    assert line["ratio"] == pytest.approx(4.0, rel=1e-12)
    assert line["ratio specjax:q_block=512 / specforge"] == pytest.approx(8.0, rel=1e-12)
    assert line["ratio specjax:q_block=512 / specjax"] == pytest.approx(2.0, rel=1e-12)
    text = tt.summary_text("m", line)
    assert len(text) == 3 and not any("not run" in t for t in text)
    (v,) = [t for t in text if "specjax:q_block=512 " in t.split("|")[0]]
    assert "specjax:q_block=512 / specforge 8.000" in v and "specjax:q_block=512 / specjax 2.000" in v
    (sj,) = [t for t in text if t.split()[2] == "specjax"]
    assert "specjax / specforge 4.000" in sj


def test_maxlen_search_from_65536_tries_131072_second():
    """--maxlen-start 65536 (the H200 long-context run): doubling reaches 131072 on the second try, then
    bisects in multiples of the quantum between the last fit and the first failure."""
    args = argparse.Namespace(tokens_per_step=32768, steps=4, warmup=1, only_seq=None, sharegpt=False, profile=False,
                              maxlen=True, maxlen_cap_s=1e9, maxlen_start=65536, sharegpt_steps=2,
                              worker_budget_s=1e9, jobs="maxlen")
    (job,) = tt.build_plan("llama3_8b", False, args)["jobs"]
    assert job["start"] == 65536 and job["limit"] == 262144
    tried = []

    def try_len(T):
        tried.append(T)
        if T > 150000:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return {}

    res = tt.maxlen_search(job, try_len)
    assert tried[:3] == [65536, 131072, 262144]
    assert res["max_seq_ok"] == 147456 and res["min_seq_failed"] == 151552
    assert all(T % job["quantum"] == 0 for T in tried)
    assert tt.specjax_variant("specjax:long_context=0") == {"long_context": 0}
    with pytest.raises(ValueError):
        tt.specjax_variant("specjax:long_context=")


def test_systems_list_keeps_a_variants_options_together():
    assert tt.split_systems("specjax,specjax:moe=mgpu,draft=p_eagle,specforge") == [
        "specjax", "specjax:moe=mgpu,draft=p_eagle", "specforge"]
    assert tt.split_systems("specjax:q_block=512") == ["specjax:q_block=512"]
    assert tt.specjax_variant(tt.split_systems("specjax:moe=mgpu,draft=p_eagle")[0]) == {"moe": "mgpu",
                                                                                         "draft": "p_eagle"}
    with pytest.raises(ValueError, match="follows no 'specjax:' variant"):
        tt.split_systems("specjax,moe=mgpu")


def test_tiny_run_with_the_fp8_target():
    """specjax:target_fp8=1 (target.compute_dtype fp8): the same random weights quantized, the train
    step runs on them and the draft still trains; the setup row reports the smaller target bytes."""
    assert tt.specjax_variant("specjax:target_fp8=1") == {"target_fp8": 1}
    with pytest.raises(ValueError, match="target_fp8 must be 0 or 1"):
        tt.specjax_variant("specjax:target_fp8=2")
    args = argparse.Namespace(tokens_per_step=128, steps=4, warmup=1, only_seq=None, sharegpt=False,
                              profile=False, maxlen=False, maxlen_cap_s=10, sharegpt_steps=2, worker_budget_s=1e9)
    plan = tt.build_plan("llama3_8b", True, args)
    rows = tt.run_inprocess(plan, systems=("specjax", "specjax:target_fp8=1"))
    setup = {r["system"]: r for r in rows if r.get("event") == "setup"}
    assert setup["specjax:target_fp8=1"]["target_compute_dtype"] == "fp8"
    assert setup["specjax:target_fp8=1"]["target_param_bytes"] < setup["specjax"]["target_param_bytes"]
    (line,) = tt.summarise(plan, rows, systems=("specjax", "specjax:target_fp8=1"))
    r = line["specjax:target_fp8=1"]
    assert "error" not in r, r
    assert r["finite"] and r["decreasing"] and r["tokens_per_s"] > 0

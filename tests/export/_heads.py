"""Shared pieces of the export tests: a tiny target folder, drafts (plain and EAGLE-3.1), head
folders written/edited by hand, the JAX draft's per-step logits, and speculators' import.

Import as `export._heads` (tests/ is on sys.path through its conftest).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts import eagle3
from specjax.drafts.ttt import shift_left
from specjax.drafts.vocab import DraftVocab
from specjax.targets import llama as tl

H, N_HEADS, N_KV, HEAD_DIM, INTER, V, VD, L = 64, 4, 2, 16, 128, 300, 120, 6
AUX = (1, 2, 3)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def target_config(**overrides) -> dict:
    hf = tl.hf_config_dict(
        vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV, head_dim=HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_parameters=LLAMA3_ROPE,
    )
    hf.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf.update(overrides)
    return hf


def make_draft(seed=0, *, fc_norm=False, norm_output=False, target_hf=None, aux=AUX, std=0.08, num_layers=1,
               mask_token_id=None):
    """(target config, Eagle3Config, numpy params with norm scales away from 1, DraftVocab); a P-EAGLE
    draft with `mask_token_id`."""
    target_hf = target_hf or target_config()
    cfg = eagle3.config_from_target(tl.LlamaTargetConfig.from_hf(target_hf), draft_vocab_size=VD,
                                    aux_layer_ids=aux, fc_norm=fc_norm, norm_output=norm_output,
                                    num_layers=num_layers, parallel_drafting=mask_token_id is not None,
                                    mask_token_id=mask_token_id)
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(cfg, jax.random.key(seed), std=std))
    # Norm scales away from 1, so a dropped or swapped norm weight changes the logits.
    norms = [params["norm"]] + [params["midlayer"][n] for n in ("hidden_norm", "input_layernorm",
                                                                "post_attention_layernorm")]
    norms += list(params.get("fc_norm", {}).values())
    norms += [layer[n] for layer in params.get("layers", {}).values()
              for n in ("input_layernorm", "post_attention_layernorm")]
    for n in norms:
        n["scale"] = (n["scale"] + 0.3 * rng.standard_normal(n["scale"].shape)).astype(np.float32)
    vocab = DraftVocab.from_ids(rng.choice(V, VD, replace=False), V)
    return target_hf, cfg, params, vocab


def write_target(folder, target_hf, seed=1) -> np.ndarray:
    """A tiny random HF Llama target (config.json + model.safetensors) at `folder`; returns its embedding."""
    tcfg = tl.LlamaTargetConfig.from_hf(target_hf)
    rng = np.random.default_rng(seed)  # numpy draws on the init's shapes: no XLA compile needed
    shapes = jax.eval_shape(lambda: tl.init_params(tcfg, jax.random.key(seed)))
    params = jax.tree_util.tree_map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    tl.save_hf_checkpoint(params, tcfg, str(folder))
    with open(os.path.join(folder, "config.json")) as f:
        on_disk = json.load(f)
    on_disk.update({k: target_hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in target_hf})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(on_disk, f, indent=1)
    return np.asarray(tl.embed_table(params, tcfg), np.float32)


def exported_head(root, seed, **draft_options) -> dict:
    """The tiny target written to root/target and a draft over it (make_draft(seed, **draft_options))
    exported fp32 to root/head; everything as one dict (root, target_hf, embed, cfg, params, vocab,
    out: the head folder)."""
    from specjax_converters.eagle3_export import export_eagle3

    target_hf = target_config()
    embed = write_target(root / "target", target_hf)
    _, cfg, params, vocab = make_draft(seed, target_hf=target_hf, **draft_options)
    out = export_eagle3(params, cfg, vocab, target_hf, root / "head", dtype="fp32")
    return {"root": root, "target_hf": target_hf, "embed": embed, "cfg": cfg, "params": params, "vocab": vocab,
            "out": str(out)}


def inputs(seed, B=1, T=16, n_aux=3):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.integers(0, V, (B, T)).astype(np.int32),
        "aux": tuple(rng.standard_normal((B, T, H)).astype(np.float32) for _ in range(n_aux)),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
    }


@functools.partial(jax.jit, static_argnums=(1, 6), compiler_options=FAST_COMPILE)
def _steps(params, cfg, x, aux, embed, positions, n_steps):
    h = eagle3.project_aux(params, aux, cfg)
    seg = jnp.ones(x.shape, jnp.int32)
    caches, out = [[] for _ in range(cfg.num_layers)], []
    for k in range(n_steps):
        h, kvs = eagle3.draft_step(params, cfg, jnp.take(embed, shift_left(x, 1 + k), axis=0), h, positions,
                                   seg, caches)
        for cache, kv in zip(caches, kvs):
            cache.append(kv)
        out.append(eagle3.draft_logits(params, cfg, h))
        h = eagle3.next_step_hidden(params, cfg, h)  # what ttt.py feeds the next step
    return out


def jax_logits(params, cfg, data, embed, n_steps=3) -> list[np.ndarray]:
    """The JAX draft's logits for TTT steps 0..n_steps-1 (step k reads token x[t+1+k])."""
    out = _steps(params, cfg, jnp.asarray(data["x"]), tuple(jnp.asarray(a) for a in data["aux"]),
                 jnp.asarray(embed), jnp.asarray(data["positions"]), n_steps)
    return [np.asarray(a) for a in out]


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ---- head folders edited by hand (the validator tests) -----------------------------------------
def read_folder(folder):
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    manifest = None
    if os.path.isfile(os.path.join(folder, "specjax_manifest.json")):
        with open(os.path.join(folder, "specjax_manifest.json")) as f:
            manifest = json.load(f)
    return config, dict(load_file(os.path.join(folder, "model.safetensors"))), manifest


def write_folder(folder, config, tensors, manifest=None):
    """Write a head; a manifest gets fresh file hashes (so only the intended defect is present)."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if manifest is not None:
        manifest = dict(manifest)
        manifest["files"] = {n: {"sha256": hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()}
                             for n in ("model.safetensors", "config.json")}
        with open(os.path.join(folder, "specjax_manifest.json"), "w") as f:
            json.dump(manifest, f, indent=2)
    return str(folder)


# ---- speculators (installed --no-deps) -----------------------------------------------------------
@contextlib.contextmanager
def speculators_importing(install_hint):
    """The body imports from speculators 0.9.0: the test is skipped when speculators is not installed
    (the reason names `install_hint`) or does not import; while the body runs, a stand-in `datasets`
    module (the names speculators.train.data imports from it) sits in sys.modules when the real one
    is not installed, and is removed right after."""
    if importlib.util.find_spec("speculators") is None:
        pytest.skip(f"speculators not installed ({install_hint})")
    stub = None
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.load_from_disk = stub.load_dataset = stub.concatenate_datasets = None
        stub.Dataset = type("Dataset", (), {})
        sys.modules["datasets"] = stub
    try:
        yield
    except ImportError as e:
        pytest.skip(f"speculators does not import here: {e}")
    finally:
        if stub is not None and sys.modules.get("datasets") is stub:
            del sys.modules["datasets"]


def import_speculators():
    """speculators 0.9.0 imported without its training-data dependency.

    `speculators/__init__` reaches speculators.train.data, which imports `datasets` (pyarrow, pandas)
    at module level for its offline data loader; the model and converter code never call it. When
    `datasets` is not installed, a stand-in module holding the two names imported there is put in
    sys.modules for the duration of the import and removed right after.
    """
    pytest.importorskip("torch")
    with speculators_importing("pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 "
                               "&& pip install loguru openai"):
        import speculators  # noqa: F401
        from speculators.convert.entrypoints import convert_model
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    return types.SimpleNamespace(convert_model=convert_model, Eagle3DraftModel=Eagle3DraftModel,
                                 Eagle3SpeculatorConfig=Eagle3SpeculatorConfig)


def speculators_logits(model, data, n_steps=3) -> list[np.ndarray]:
    """Run speculators' own Eagle3DraftModel.forward (its TTT loop, KV cache, masks, positions + k,
    norm_output feedback) and catch the lm_head output of each step. Step 0 is fed x[t+1]; the model
    itself then feeds x[t+1+k] (its teacher forcing shifts the original ids by 1+k)."""
    import torch

    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().float().numpy()))
    try:
        with torch.no_grad():
            x = torch.from_numpy(np.array(shift_left(jnp.asarray(data["x"]), 1))).long()
            dtype = model.fc.weight.dtype
            model(hidden_states=torch.from_numpy(np.concatenate(data["aux"], -1)).to(dtype), input_ids=x,
                  document_ids=torch.zeros_like(x), position_ids=torch.from_numpy(data["positions"]).long(),
                  ttt_steps=n_steps)
    finally:
        hook.remove()
    return caught


def speculators_configs(algorithm, k, verifier_dir, *, rms_norm_eps, num_layers=1):
    """The two configs a speculators draft model is built from, for a head over the tiny target:
    its Llama layer config (sdpa attention, fp32-friendly on the CPU) and its SpeculatorsConfig
    (`algorithm`, greedy proposals of k tokens, the Llama verifier in `verifier_dir`)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    tl_conf = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=num_layers,
                          num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD_DIM,
                          rms_norm_eps=rms_norm_eps, max_position_embeddings=4096,
                          rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
    tl_conf._attn_implementation = "sdpa"
    spec = SpeculatorsConfig(algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=str(verifier_dir),
                                                     architectures=["LlamaForCausalLM"]))
    return tl_conf, spec


def load_exported_head(model, folder, embed):
    """Our exported head (folder/model.safetensors) loaded strictly into a speculators draft model:
    `midlayer.` read as `layers.0.`, the target's embedding as its embed_tokens, the vocab maps
    through load_vocab_mappings; every draft tensor must load (the verifier's norm / lm_head are
    not in a head). Returns the head's tensors."""
    import torch
    from safetensors.numpy import load_file

    ours = load_file(os.path.join(folder, "model.safetensors"))
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): torch.from_numpy(v)
             for k, v in ours.items() if k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = torch.from_numpy(embed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == []
    assert sorted(m for m in missing if not m.startswith("verifier_")) == ["d2t", "t2d"], missing
    model.load_vocab_mappings(torch.from_numpy(ours["t2d"]), torch.from_numpy(ours["d2t"]))
    return ours


def speculators_head(sp, folder, verifier_dir, *, fc_norm=False, norm_output=False, seed=0, aux=AUX):
    """A head as speculators itself trains and saves it (Eagle3DraftModel.save_pretrained): layers.0.*,
    speculators_config, top-level aux ids in vLLM's input convention. Random weights, norm scales
    away from 1. Returns the (fp32, sdpa) model."""
    import torch

    tl_conf, spec = speculators_configs("eagle3", 3, verifier_dir, rms_norm_eps=1e-5)
    config = sp.Eagle3SpeculatorConfig(transformer_layer_config=tl_conf, draft_vocab_size=VD,
                                       eagle_aux_hidden_state_layer_ids=[a + 1 for a in aux], fc_norm=fc_norm,
                                       norm_output=norm_output, speculators_config=spec)
    model = sp.Eagle3DraftModel(config)
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.sort(rng.choice(V, VD, replace=False)).astype(np.int64))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(VD))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_"):
                continue
            if p.ndim == 1:  # norms
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(folder))
    return model.float().eval()


def import_speculators_model(package: str, model: str, config: str, **extra):
    """speculators 0.9.0's pieces for comparing a block draft (DFlash and its kin) with ours: torch, the
    DFlash core (select_anchors), its eager losses, `Model` / `Config` (the classes `model` / `config`
    of speculators.models.<package>), SpeculatorsConfig, VerifierConfig and the greedy proposal config
    (`Greedy`); `extra`: more names, each "module:attribute". Skips as speculators_importing does."""
    torch = pytest.importorskip("torch")
    with speculators_importing("pip install --no-deps speculators==0.9.0"):
        import speculators.models.dflash.core as core
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.losses import eager
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        family = importlib.import_module(f"speculators.models.{package}")
        more = {}
        for name, where in extra.items():
            module, _, attr = where.partition(":")
            more[name] = getattr(importlib.import_module(module), attr) if attr else importlib.import_module(module)
        Model, Config = getattr(family, model), getattr(family, config)
    return types.SimpleNamespace(torch=torch, core=core, eager=eager, Model=Model, Config=Config,
                                 SpeculatorsConfig=SpeculatorsConfig, VerifierConfig=VerifierConfig,
                                 Greedy=GreedyTokenProposalConfig, **more)


def speculators_block_model(sp, cfg, algorithm: str, state, *, embed, verifier_norm, verifier_head, **config):
    """speculators' draft model of `algorithm` for our block-draft config `cfg` (a Qwen3 layer config of
    its widths, eager attention, the greedy proposal), loaded strict from `state` (file name -> array,
    our export's state dict) plus what a speculators checkpoint leaves to the verifier (its embedding,
    final norm and lm_head rows), with lm_head's gradient opened (frozen there) so it is compared too;
    fp32, in train mode. `config`: the family's own speculators config fields."""
    from transformers import Qwen3Config

    layer = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters={"rope_type": "default", "rope_theta": cfg.rope.theta}, tie_word_embeddings=False)
    layer._attn_implementation = "eager"  # plain masked softmax (flex attention needs a compiler)
    spec = sp.SpeculatorsConfig(algorithm=algorithm,
                                proposal_methods=[sp.Greedy(speculative_tokens=cfg.num_draft_tokens)],
                                default_proposal_method="greedy",
                                verifier=sp.VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]))
    conf = sp.Config(transformer_layer_config=layer, draft_vocab_size=cfg.draft_vocab_size, block_size=cfg.block_size,
                     aux_hidden_state_layer_ids=[i + 1 for i in cfg.aux_layer_ids], mask_token_id=cfg.mask_token_id,
                     sample_from_anchor=cfg.sample_from_anchor, speculators_config=spec, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sp.Model(conf)
    t = lambda a: sp.torch.from_numpy(np.ascontiguousarray(np.array(a)))  # noqa: E731
    weights = {k: t(v) for k, v in state.items()}
    weights.update({"embed_tokens.weight": t(embed), "verifier_norm.weight": t(verifier_norm),
                    "verifier_lm_head.weight": t(verifier_head)})
    model.load_state_dict(weights, strict=True)
    model.lm_head.weight.requires_grad_(True)
    return model.float().train()


@contextlib.contextmanager
def speculators_anchors(sp, anchors, valid):
    """While the body runs, speculators' select_anchors returns our anchors and their validity (row 0
    of [1, N] arrays); yields the number of anchors (its max_anchors)."""
    a = sp.torch.from_numpy(np.array(anchors[0], np.int64))
    v = sp.torch.from_numpy(np.array(valid[0]))
    orig = sp.core.select_anchors
    sp.core.select_anchors = lambda loss_mask, num_anchors, block_size: (a.clone(), v.clone())
    try:
        yield len(a)
    finally:
        sp.core.select_anchors = orig


def speculators_inputs(torch, batch) -> dict:
    """A block-draft test batch (aux taps, ids, loss mask, the verifier's pre-norm final states,
    segment ids, positions) as speculators' forward takes it: taps concatenated, documents numbered
    with -1 for padding, int64 ids."""
    doc = np.where(batch["segment_ids"] > 0, batch["segment_ids"], -1)  # speculators pads documents with -1
    return dict(hidden_states=torch.from_numpy(np.concatenate(batch["aux"], -1)),
                input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
                loss_mask=torch.from_numpy(batch["loss_mask"]),
                verifier_last_hidden_states=torch.from_numpy(batch["pre_norm"]),
                document_ids=torch.from_numpy(doc.astype(np.int64)),
                position_ids=torch.from_numpy(batch["positions"].astype(np.int64)))


def jitter_params(params, seed: int, rule=None):
    """Draft weights moved away from the init, reproducibly (numpy generator seed + 100, drawn in
    tree order): every norm scale 1 +- 0.3 (normal), every other leaf `rule(path, x, rng)` (the
    family's own, default unchanged)."""
    rng = np.random.default_rng(seed + 100)

    def jitter(path, x):
        if path[-1].key == "scale":
            return jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape), jnp.float32)
        return x if rule is None else rule(path, x, rng)

    return jax.tree_util.tree_map_with_path(jitter, params)

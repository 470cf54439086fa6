"""The draft-family registry (specjax.drafts.family): lookups by draft.type, by draft config, by the
run_meta.json name and by a head's config.json; each family's own draft.* and train.* keys (another
family's refused by name when the config loads); the run_meta.json round trip; and a family defined
here, registered and trained for one step through the normal set-up (adding a family needs no edit
anywhere else)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ConfigError, config_to_dict, load_config
from specjax.config_fields import DraftSection, ranged
from specjax.drafts import dflash, eagle3, family as registry
from specjax.drafts.families import (META_KEY, draft_config_from_meta, family_for_head, family_for_type,
                                     family_from_meta, family_of, known_types)
from specjax.layers.rope import RopeSpec
from specjax.train.setup import build_run_setup, make_mesh
from specjax.train.step import init_state

V = 96


# ---------------------------------------------------------------------------------------------
# draft configs of the built-in families, without a target
# ---------------------------------------------------------------------------------------------
def _eagle3_config(parallel=False):
    return eagle3.Eagle3Config(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=48,
                               aux_layer_ids=(0, 1, 2), rope=RopeSpec(theta=1000.0), parallel_drafting=parallel,
                               mask_token_id=3 if parallel else None)


def _dflash_config():
    return dflash.DFlashConfig(hidden_size=32, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, intermediate_size=64, vocab_size=V, draft_vocab_size=48,
                               aux_layer_ids=(1,), mask_token_id=3, block_size=4)


DRAFT_CONFIGS = {"eagle3": _eagle3_config, "p_eagle": lambda: _eagle3_config(parallel=True), "dflash": _dflash_config}


def test_lookups_by_type_config_and_meta_name():
    assert known_types()[:3] == ("eagle3", "p_eagle", "dflash")
    for draft_type, make in DRAFT_CONFIGS.items():
        family = family_for_type(draft_type)
        assert family.draft_type == draft_type and family_of(make()) is family
        assert isinstance(load_config(None, [f"draft.type={draft_type}"]).draft, family.section_class)
    assert family_from_meta(None) is family_for_type("eagle3")  # runs written before DFlash
    assert family_from_meta("eagle3") is family_for_type("eagle3")  # P-EAGLE configs read back the same way
    assert family_from_meta("dflash") is family_for_type("dflash")
    assert family_for_head({"architectures": ["DFlashDraftModel"]}) is family_for_type("dflash")
    assert family_for_head({"architectures": ["LlamaForCausalLMEagle3"]}) is family_for_type("eagle3")


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"draft.type 'medusa' is not a draft family .* known: 'eagle3', 'p_eagle', "
                                         r"'dflash'"):
        family_for_type("medusa")
    with pytest.raises(ValueError, match=r"draft_family='medusa' is not a draft family .*'eagle3', 'dflash'"):
        family_from_meta("medusa")
    with pytest.raises(ValueError, match="is the draft config of no registered draft family"):
        family_of(object())
    with pytest.raises(ConfigError, match=r"`draft.type` = 'medusa' is not one of 'eagle3' \| 'p_eagle' \| 'dflash'"):
        load_config(None, ["draft.type=medusa"])


@pytest.mark.parametrize("overrides,match", [
    (["draft.block_size=8"], r"`draft.block_size` is not a key of draft.type=eagle3 \(EAGLE-3\); it belongs to "
                             r"draft.type=dflash or draft.type=jetspec or draft.type=dspark or draft.type=dflash2 or "
                             r"draft.type=xpress. Fix: remove it or set draft.type=dflash"),
    (["draft.mask_token_id=3"], r"`draft.mask_token_id` is not a key of draft.type=eagle3 \(EAGLE-3\); it belongs to "
                                r"draft.type=p_eagle or draft.type=dflash or draft.type=jetspec or draft.type=dspark or "
                                r"draft.type=dflash2 or draft.type=xpress. Fix: remove it or set draft.type=p_eagle"),
    (["draft.type=dflash", "draft.fc_norm=true"], r"`draft.fc_norm` is not a key of draft.type=dflash \(DFlash\); "
                                                  r"it belongs to draft.type=eagle3 or draft.type=p_eagle"),
    (["draft.type=p_eagle", "draft.sample_from_anchor=true"], r"`draft.sample_from_anchor` is not a key of "
                                                              r"draft.type=p_eagle \(P-EAGLE\)"),
    (["train.cod_ratio=0.5"], r"`train.cod_ratio` = 0.5 is not read by draft.type=eagle3 \(EAGLE-3; its objective is "
                              r"train.loss\); it is read by draft.type=p_eagle. Fix: remove it \(default 0.7\)"),
    (["draft.type=dflash", "train.lk_eta=1"], r"`train.lk_eta` = 1.0 is not read by draft.type=dflash \(DFlash; its "
                                              r"objective is train.dflash_objective\)"),
    (["draft.type=p_eagle", "train.dflash_anchors=8"], r"it is read by draft.type=dflash"),
])
def test_another_familys_key_is_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides", [
    ["draft.ttt_steps=3", "draft.step_decay=1.0", "draft.fc_norm=true", "draft.norm_output=true", "train.loss=lk_alpha",
     "train.lk_eta=2"],
    ["draft.type=p_eagle", "draft.ttt_steps=3", "draft.mask_token_id=5", "train.cod_ratio=0.5", "train.cod_ratio_min=0.1"],
    ["draft.type=dflash", "draft.mask_token_id=5", "draft.block_size=4", "draft.sample_from_anchor=true",
     "train.dflash_anchors=8", "train.dflash_decay_gamma=0"],
])
def test_each_familys_own_keys_load_and_print(overrides):
    cfg = load_config(None, overrides)
    d = config_to_dict(cfg)["draft"]
    own = {f.name for f in dataclasses.fields(family_for_type(cfg.draft.type).section_class)}
    assert set(d) == own and {f.name for f in dataclasses.fields(DraftSection)} <= own
    for o in overrides:
        key, _, _ = o.partition("=")
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) is not None


def test_a_later_layer_that_switches_the_type_drops_the_earlier_types_keys(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("draft:\n  ttt_steps: 3\n  draft_vocab_size: 64\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ndraft:\n  type: dflash\n  block_size: 4\n")
    cfg = load_config(str(child))
    assert (cfg.draft.type, cfg.draft.block_size, cfg.draft.draft_vocab_size) == ("dflash", 4, 64)
    assert load_config(None, ["draft.ttt_steps=2", "draft.type=dflash"]).draft.type == "dflash"
    with pytest.raises(ConfigError, match="`draft.ttt_steps` is not a key of draft.type=dflash"):
        load_config(None, ["draft.type=dflash", "draft.ttt_steps=2"])


@pytest.mark.parametrize("draft_type", list(DRAFT_CONFIGS))
def test_run_meta_round_trip(draft_type):
    family = family_for_type(draft_type)
    dcfg = DRAFT_CONFIGS[draft_type]()
    meta = family.run_meta(dcfg)
    assert (META_KEY in meta) == (draft_type == "dflash")  # absent for EAGLE-3 heads, as in runs before DFlash
    assert meta.get(META_KEY, "eagle3") == ("dflash" if draft_type == "dflash" else "eagle3")
    assert draft_config_from_meta(meta) == dcfg


# ---------------------------------------------------------------------------------------------
# a family of this test's own, through the normal set-up
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeSection(DraftSection):
    type: str = "probe"
    probe_scale: float = ranged(1.0, gt=0.0)


@dataclass(frozen=True)
class ProbeConfig:
    hidden_size: int
    draft_vocab_size: int
    tap: int


class ProbeFamily(registry.DraftFamily):
    """A linear head on one target tap, trained to match the target's final hidden state's scores."""
    draft_type: ClassVar[str] = "probe"
    display_name: ClassVar[str] = "Probe"
    meta_name: ClassVar[str] = "probe"
    section_class: ClassVar[type] = ProbeSection
    config_class: ClassVar[type] = ProbeConfig

    def default_aux_layer_ids(self, cfg, target):
        return (target.num_layers // 2,)

    def make_draft_config(self, cfg, target, aux_ids):
        return ProbeConfig(int(target.config.hidden_size), cfg.draft.draft_vocab_size, aux_ids[0])

    def init_params(self, draft_cfg, key, *, std=0.02, lm_head_rows=None):
        return {"w": std * jax.random.normal(key, (draft_cfg.hidden_size, draft_cfg.hidden_size))}

    def param_logical_axes(self, draft_cfg):
        return {"w": (None, None)}

    def config_to_dict(self, draft_cfg):
        return dataclasses.asdict(draft_cfg)

    def config_from_dict(self, d):
        return ProbeConfig(**d)

    def make_objective(self, cfg, draft_cfg):
        return cfg.draft.probe_scale

    def loss_fn(self, target, draft_cfg, scale, compute_dtype):
        def loss_fn(params, target_params, vocab, batch, step=None):
            final, aux = target.forward(target_params, batch["input_ids"], aux_layer_ids=(draft_cfg.tap,),
                                        positions=batch["positions"], segment_ids=batch["segment_ids"])
            loss = scale * jnp.mean((aux[0] @ params["w"] - final) ** 2)
            return loss, {"loss": loss}

        return loss_fn


@pytest.fixture
def probe_family():
    family = registry.register(ProbeFamily())
    yield family
    registry.unregister("probe")


def _tiny_target(tmp_path):
    from specjax.targets import llama, load_target

    cfg = llama.LlamaTargetConfig.create(architecture="LlamaForCausalLM", vocab_size=V, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000.0)
    path = str(tmp_path / "target")
    llama.save_hf_checkpoint(llama.init_params(cfg, jax.random.key(0)), cfg, path)
    return path, load_target(path, dtype="float32")


def test_a_new_family_trains_through_the_normal_set_up(probe_family, tmp_path):
    path, target = _tiny_target(tmp_path)
    cfg = load_config(None, [f"target.path={path}", "target.dtype=float32", "draft.type=probe",
                             "draft.probe_scale=2.0", "draft.draft_vocab_size=16", "train.steps=2"])
    with pytest.raises(ConfigError, match=r"`draft.probe_scale` is not a key of draft.type=eagle3 \(EAGLE-3\); it "
                                          r"belongs to draft.type=probe"):
        load_config(None, ["draft.probe_scale=2.0"])
    setup = build_run_setup(cfg, target, make_mesh(cfg))
    assert setup.family is probe_family and setup.objective == 2.0
    assert setup.draft_config == ProbeConfig(32, 16, 1)
    state = init_state(setup.init_draft_params(), setup.optimizer)
    rows = jax.device_count()  # the batch splits over the mesh's devices
    ids = jnp.asarray(np.random.RandomState(0).randint(0, V, (rows, 16)), jnp.int32)
    batch = {"input_ids": ids, "loss_mask": jnp.ones_like(ids), "segment_ids": jnp.ones_like(ids),
             "positions": jnp.tile(jnp.arange(16, dtype=jnp.int32)[None], (rows, 1))}
    vocab = {"draft_ids": jnp.arange(16, dtype=jnp.int32), "t2d": jnp.zeros(V, bool), "d2t": jnp.zeros(16, jnp.int32)}
    before = np.asarray(state["params"]["w"])
    state, metrics = setup.fns.train_step(state, target.params, vocab, batch)
    assert int(state["step"]) == 1 and np.isfinite(float(metrics["loss"]))
    assert not np.array_equal(np.asarray(state["params"]["w"]), before)
    meta = probe_family.run_meta(setup.draft_config)
    assert meta[META_KEY] == "probe" and draft_config_from_meta(meta) == setup.draft_config


def test_default_config_dict_has_every_draft_types_keys():
    """What a saved config's missing key is compared as (a run saved before the per-type sections, or
    of another type): each type's own defaults are there."""
    from specjax.config import default_config_dict

    draft = default_config_dict()["draft"]
    assert draft["type"] == "eagle3" and draft["ttt_steps"] == 7 and draft["block_size"] == 16
    for family in registry.FAMILIES.values():
        assert {f.name for f in dataclasses.fields(family.section_class)} <= set(draft)

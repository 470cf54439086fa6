import pytest

from specjax.config import Config, ConfigError, config_to_dict, describe_sections, load_config


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_and_types(tmp_path):
    cfg = load_config(write(tmp_path, "a.yaml", "train:\n  steps: 5\ndata:\n  train_files: [x.jsonl]\n"))
    assert cfg.train.steps == 5 and cfg.data.train_files == ("x.jsonl",)
    assert cfg.draft.ttt_steps == Config().draft.ttt_steps
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


def test_roundtrip_dict_and_help():
    d = config_to_dict(Config())
    assert set(d) >= {"run", "target", "draft", "data", "optim", "train", "checkpoint", "export", "parallelism"}
    text = describe_sections()
    assert "ttt_steps" in text and "parallelism:" in text


def test_all_shipped_configs_load(repo_root):
    import glob
    import os

    paths = glob.glob(os.path.join(repo_root, "configs", "*.yaml"))
    assert paths
    for p in paths:
        load_config(p)

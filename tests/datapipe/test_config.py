import pytest

from datapipe.curate.config import CurateConfig, config_hash, diff_configs, load_config, result_affecting
from datapipe.core.config import ConfigError, from_dict, help_lines


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_unknown_key_is_named_with_its_dotted_path_and_the_file(tmp_path):
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\ndedup: {exact: {enabeld: true}}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key 'dedup.exact.enabeld'; allowed: \['enabled', 'partitions'\]"):
        load_config(p)


def test_bad_values_name_the_key_the_value_and_what_is_allowed(tmp_path):
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\n")
    with pytest.raises(ConfigError, match=r"'normalize.unicode_form' must be one of \['NFC', 'NFKC', 'none'\], got 'NFD'"):
        load_config(p, ["normalize.unicode_form=NFD"])
    with pytest.raises(ConfigError, match=r"'read.batch_size' must be an integer, got 'many'"):
        load_config(p, ["read.batch_size=many"])
    with pytest.raises(ConfigError, match=r"c.yaml: read.batch_size must be > 0, got 0"):
        load_config(p, ["read.batch_size=0"])
    with pytest.raises(ConfigError, match=r"'inputs\[0\].format' must be one of"):
        load_config(p, ["inputs=[{path: a, format: csv}]"])
    with pytest.raises(ConfigError, match="inputs must list at least one input"):
        load_config(write(tmp_path, "output: {dir: o}\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_unknown_filter_is_named(tmp_path):
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\nfilters: {web: {gopher_qualty: {}}}\n")
    with pytest.raises(ConfigError, match=r"filters.web.gopher_qualty"):
        load_config(p)


def test_overrides_and_cli_flags(tmp_path):
    p = write(tmp_path, "inputs: [{path: x.jsonl, domain_field: source, text_field: body}]\n")
    cfg = load_config(p, ["dedup.exact.enabled=false", "tokenizer.train.vocab_size=1000"],
                      inputs=["a/*.jsonl", "s3://b/p.parquet"], output="out/x", ray_address="auto")
    assert cfg.dedup.exact.enabled is False and cfg.tokenizer.train.vocab_size == 1000
    assert [i.path for i in cfg.inputs] == ["a/*.jsonl", "s3://b/p.parquet"]
    assert all(i.text_field == "body" and i.domain_field == "source" for i in cfg.inputs)  # options carried over
    assert cfg.output.dir == "out/x" and cfg.ray.address == "auto"


def test_config_hash_ignores_where_it_runs_and_diff_names_keys():
    a = from_dict(CurateConfig, {"inputs": [{"path": "x"}], "output": {"dir": "o1"}, "ray": {"address": "auto"}})
    b = from_dict(CurateConfig, {"inputs": [{"path": "x"}], "output": {"dir": "o2"}})
    c = from_dict(CurateConfig, {"inputs": [{"path": "x"}], "normalize": {"enabled": False}})
    assert config_hash(a) == config_hash(b) != config_hash(c)
    assert diff_configs(result_affecting(a), result_affecting(c)) == ["normalize.enabled: True -> False"]


def test_every_field_has_a_note():
    lines = list(help_lines(CurateConfig))
    assert any(line.startswith("dedup.exact.enabled: bool = True") for line in lines)
    assert all(not line.rstrip().endswith("#") for line in lines), [l for l in lines if l.rstrip().endswith("#")]

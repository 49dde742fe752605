import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from datapipe.curation.config import INPUT_FLAG_OWN, CurateConfig, InputConfig, config_hash, diff_configs, load_config, result_affecting
from datapipe.curation.preferences import PreferenceConfig
from datapipe.curation.readers import plan_units, read_unit
from datapipe.core.config import ConfigError, from_dict, help_lines, load, note
from datapipe.train.config import TrainConfig, load_train_config

REPO = Path(__file__).resolve().parents[2]
ROOTS = (CurateConfig, TrainConfig, PreferenceConfig)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_unknown_key_is_named_with_its_dotted_path_and_the_file(tmp_path):
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\ndedup: {exact: {enabeld: true}}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key 'dedup.exact.enabeld'; allowed: \['enabled', 'partitions'\]"):
        load_config(p)


def test_a_set_mistake_names_the_set_flag_not_the_recipe_file(tmp_path):
    """A --set value replaces the recipe's: its mistake is the flag's (`datapipe run`'s recipe is a file the user
    never wrote). A mistake of the recipe's own keys still names the file."""
    with pytest.raises(ConfigError, match=r"^--set dedup.exact.enabeld=true: unknown config key 'dedup.exact.enabeld'"):
        load_config(write(tmp_path, "inputs: [{path: x.jsonl}]\n"), ["dedup.exact.enabeld=true"])
    with pytest.raises(ConfigError, match=r"^--set inputs.0.txt_field=body: unknown config key 'inputs\[0\].txt_field'"):
        load_config(write(tmp_path, "inputs: [{path: x.jsonl}]\n"), ["inputs.0.txt_field=body"])
    with pytest.raises(ConfigError, match=r"^--set dedup={exact: {enabeld: 1}}: unknown config key 'dedup.exact.enabeld'"):
        load_config(write(tmp_path, "inputs: [{path: x.jsonl}]\n"), ["dedup={exact: {enabeld: 1}}"])  # a whole section
    with pytest.raises(ConfigError, match=r"^--set data.seq_len=4096: model.max_seq_len must be >= data.seq_len=4096"):
        load_train_config(None, ["train.steps=2", "data.seq_len=4096"])
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\nread: {batch_size: 0}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: read.batch_size must be > 0, got 0"):
        load_config(p, ["read.block_bytes=9000"])  # the recipe's own mistake, another key set


def test_bad_values_name_the_key_the_value_and_what_is_allowed(tmp_path):
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\n")
    with pytest.raises(ConfigError, match=r"'normalize.unicode_form' must be one of \['NFC', 'NFKC', 'none'\], got 'NFD'"):
        load_config(p, ["normalize.unicode_form=NFD"])
    with pytest.raises(ConfigError, match=r"'read.batch_size' must be an integer, got 'many'"):
        load_config(p, ["read.batch_size=many"])
    with pytest.raises(ConfigError, match=r"^--set read.batch_size=0: read.batch_size must be > 0, got 0"):
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
    p = write(tmp_path, "inputs: [{path: x.jsonl, domain_field: source, text_field: body, domain: web}]\n")
    cfg = load_config(p, ["dedup.exact.enabled=false", "tokenizer.train.vocab_size=1000"],
                      inputs=["a/*.jsonl", "s3://b/p.parquet"], output="out/x", ray_address="auto")
    assert cfg.dedup.exact.enabled is False and cfg.tokenizer.train.vocab_size == 1000
    assert [i.path for i in cfg.inputs] == ["a/*.jsonl", "s3://b/p.parquet"]
    assert all(i.text_field == "body" and i.domain == "web" for i in cfg.inputs)  # options carried over
    assert all(i.domain_field == "domain" for i in cfg.inputs)  # ... but not the file's domain_field
    assert cfg.output.dir == "out/x" and cfg.ray.address == "auto"
    # --set names the field the --input files carry their domain in
    cfg = load_config(p, ["inputs.0.domain_field=lang"], inputs=["a.jsonl", "b.jsonl"])
    assert [i.domain_field for i in cfg.inputs] == ["lang", "lang"]
    # the command-line flags win over --set, and a typo in the inherited options is still an error
    assert load_config(p, ["output.dir=o1"], output="o2").output.dir == "o2"
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key 'inputs\[0\].txt_field'"):
        load_config(write(tmp_path, "inputs: [{path: x.jsonl, txt_field: body}]\n"), inputs=["a.jsonl"])


def test_input_flag_reads_the_records_own_domain_with_the_quickstart_recipe(tmp_path):
    # docs/curation.md: "If a record has its own `domain` field, that field names the record's domain."
    records = [{"id": "a", "text": "a first document", "domain": "news"},
               {"id": "b", "text": "a second document", "domain": "forum"},
               {"id": "c", "text": "a third document"}]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(REPO / "configs" / "quickstart.yaml", inputs=[str(data)])
    (inp,) = cfg.inputs
    domains = [d for unit in plan_units(cfg.inputs)
               for batch, _ in read_unit(unit, 0, inp, cfg.read) for d in batch.column("domain").to_pylist()]
    assert domains == ["news", "forum", "default"]


def test_input_flag_help_and_docs_name_exactly_the_options_it_inherits(capsys):
    from datapipe.cli import main

    with pytest.raises(SystemExit):
        main(["curate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    options = help_text[help_text.index("options:"):]
    flag = options[options.index("--input PATH"):options.index("--output DIR")]
    curation = " ".join((REPO / "docs" / "curation.md").read_text().split())
    bullet = curation[curation.index("- `--input` takes"):].split(" - ")[0]
    inherited = [f for f in InputConfig.__dataclass_fields__ if f not in INPUT_FLAG_OWN]
    for text in (flag, bullet):
        assert all(name in text for name in inherited + list(INPUT_FLAG_OWN)), text


def test_config_hash_ignores_where_it_runs_and_diff_names_keys():
    a = from_dict(CurateConfig, {"inputs": [{"path": "x"}], "output": {"dir": "o1"}, "ray": {"address": "auto"}})
    b = from_dict(CurateConfig, {"inputs": [{"path": "x"}], "output": {"dir": "o2"}})
    c = from_dict(CurateConfig, {"inputs": [{"path": "x"}], "normalize": {"enabled": False}})
    assert config_hash(a) == config_hash(b) != config_hash(c)
    assert diff_configs(result_affecting(a), result_affecting(c)) == ["normalize.enabled: True -> False"]


@pytest.mark.parametrize("root", ROOTS, ids=lambda r: r.__name__)
def test_every_field_has_a_note(root):
    lines = list(help_lines(root))
    assert len(lines) > 10
    assert all(not line.rstrip().endswith("#") for line in lines), [l for l in lines if l.rstrip().endswith("#")]
    assert all("Field(" not in line for line in lines)  # a default that is a dataclasses.Field leaked into the note


def test_the_loaders_of_every_command_share_the_rules(tmp_path):
    p = write(tmp_path, "train: {stepz: 3}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown config key 'train.stepz'; allowed: \['ckpt_every'"):
        load_train_config(p)
    p = write(tmp_path, "inputs: [x.jsonl]\nshard_rows: 0\n")
    with pytest.raises(ConfigError, match=r"c.yaml: shard_rows must be an integer >= 1, got 0"):
        load(PreferenceConfig, p)
    with pytest.raises(ConfigError, match=r"c.yaml: inputs must name at least one file"):
        load(PreferenceConfig, write(tmp_path, "output: o\n"))
    cfg = load(PreferenceConfig, write(tmp_path, "inputs: [x.jsonl]\n"), ["max_prompt_tokens=9"],
               {"inputs": ["y.jsonl"], "output": None})
    assert cfg.inputs == ["y.jsonl"] and cfg.max_prompt_tokens == 9 and cfg.output == "out/preferences"
    # YAML 1.1 reads 1e-3 as a string; a float key takes it as the number it is
    assert load_train_config(None, ["optim.lr=1e-3"]).optim.lr == 0.001
    with pytest.raises(ConfigError, match=r"^--set optim.lr=fast: 'optim.lr' must be a number, got 'fast'"):
        load_train_config(None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"^--set train.steps=1e3: 'train.steps' must be an integer, got '1e3'"):
        load_train_config(None, ["train.steps=1e3"])


def test_recipe_and_override_mistakes_are_one_line_errors(tmp_path):
    bad = write(tmp_path, "inputs: [{path: x.jsonl}\noutput: {dir: o}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    assert str(caught.value).startswith(f"{bad}: not valid YAML: ") and "line 2" in str(caught.value)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="is a folder; the config must be a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"c.yaml: the config must be a mapping of keys to values, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))
    p = write(tmp_path, "inputs: [{path: x.jsonl}]\n")
    with pytest.raises(ConfigError, match=r"--set read.batch_size: the value '\[1' is not valid YAML: .*; quote it"):
        load_config(p, ["read.batch_size=[1"])
    with pytest.raises(ConfigError, match=r"--set inputs.2.path: 'inputs' is a list of 1 item\(s\); '2' is not an index"):
        load_config(p, ["inputs.2.path=y"])
    with pytest.raises(ConfigError, match=r"--set read..batch_size: 'read..batch_size' is not a dotted key"):
        load_config(p, ["read..batch_size=1"])
    assert load_config(p, ["inputs.0.path=y.jsonl"]).inputs[0].path == "y.jsonl"
    with pytest.raises(ConfigError, match=r"unknown config key '1'"):  # not a TypeError from sorting 1 and 'b'
        load_config(write(tmp_path, "inputs: [{path: x}]\n1: a\n"))


@dataclass(frozen=True, kw_only=True)
class _Section:
    RENAMED: ClassVar[dict[str, str]] = {"size": "bytes"}
    bytes: int = note(1, help="a size")


@dataclass(frozen=True, kw_only=True)
class _Root:  # a test-only root: no key of the real roots has been renamed yet
    RENAMED: ClassVar[dict[str, str]] = {"out": "output.dir", "output.folder": "output.dir"}
    output: _Section = note(_Section(), help="where")
    steps: int = note(1, help="how many")


def test_a_renamed_key_is_an_error_naming_the_new_one(tmp_path):
    # the real one: curate-preferences names its EOS by token now
    with pytest.raises(ConfigError, match=r"c.yaml: config key 'eos_id' was renamed to 'eos_token'; use the new name"):
        load(PreferenceConfig, write(tmp_path, "inputs: [x.jsonl]\neos_id: 0\n"))
    assert "# eos_id was renamed to eos_token" in list(help_lines(PreferenceConfig))
    with pytest.raises(ConfigError, match=r"c.yaml: config key 'out' was renamed to 'output.dir'; use the new name"):
        load(_Root, write(tmp_path, "out: x\n"))
    with pytest.raises(ConfigError, match=r"^--set output.folder=x: config key 'output.folder' was renamed to 'output.dir'"):
        load(_Root, None, ["output.folder=x"])
    with pytest.raises(ConfigError, match=r"config key 'output.size' was renamed to 'output.bytes'"):
        from_dict(_Root, {"output": {"size": 3}})
    assert load(_Root, None, ["output.bytes=3"]).output.bytes == 3
    lines = list(help_lines(_Root))
    assert "# out was renamed to output.dir" in lines and "# output.size was renamed to output.bytes" in lines

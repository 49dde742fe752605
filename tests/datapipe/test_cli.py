"""The command line: the main job on the embedded default corpus, and clean errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from datapipe.curate import embedded
from datapipe.cli import main
from datapipe.core.shards import read_manifest


def test_run_curates_the_embedded_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    few = embedded._stdlib_files()[:40]  # the real files, fewer of them: a fast test
    monkeypatch.setattr(embedded, "_stdlib_files", lambda: few)
    out = tmp_path / "out"
    code = main(["run", "--output", str(out), "--man-pages", "12", "--executor", "local", "--no-progress",
                 "--set", "tokenizer.train.vocab_size=600", "--set", "tokenizer.train.sample_bytes=300000"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "stage" in printed and "exact_dedup" in printed and "filters" in printed
    manifest = read_manifest(out)
    assert "code" in manifest["domains"] and "prose" in manifest["domains"]
    corpus = embedded.prepare(12)
    if shutil.which("man") and embedded.MAN_ROOT.is_dir():
        pages = [json.loads(line) for line in corpus["manual"].read_text().splitlines()]
        assert 0 < len(pages) <= 12
        assert all(p["text"] and "\x08" not in p["text"] for p in pages)  # rendered, overstrike removed
        assert len({p["lang"] for p in pages}) > 1  # translated pages come first: several languages
    # a second run with the same config finds the work done
    assert main(["run", "--output", str(out), "--man-pages", "12", "--executor", "local", "--no-progress",
                 "--set", "tokenizer.train.vocab_size=600", "--set", "tokenizer.train.sample_bytes=300000"]) == 0


def test_config_errors_exit_2_with_the_key_named(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("inputs: [{path: x.jsonl}]\noutput: {shard_byte: 10}\n")
    assert main(["curate", str(cfg)]) == 2
    assert "unknown config key 'output.shard_byte'" in capsys.readouterr().err


def test_missing_input_exits_2_before_any_work(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"inputs: [{{path: '{tmp_path}/none/*.jsonl'}}]\noutput: {{dir: '{tmp_path}/out'}}\n")
    assert main(["curate", str(cfg), "--executor", "local"]) == 2
    assert "none/*.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_config_reference_lists_every_section(capsys):
    assert main(["config-reference"]) == 0
    out = capsys.readouterr().out
    for key in ("inputs[].path", "read.block_bytes", "dedup.exact.enabled", "tokenizer.eos_token", "output.shard_bytes", "ray.address"):
        assert key in out

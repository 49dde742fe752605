"""The command line: the main job on the embedded default corpus, and clean errors."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from datapipe.curation import embedded
from datapipe.cli import main
from datapipe.core.shards import read_manifest


def test_run_curates_the_embedded_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "cache"))  # a corpus of its own (40 files)
    few = embedded._stdlib_files()[:40]  # the real files, fewer of them: a fast test
    monkeypatch.setattr(embedded, "_stdlib_files", lambda: few)
    out = tmp_path / "out"
    args = ["run", "--output", str(out), "--man-pages", "12", "--executor", "local", "--no-progress", "--train-steps", "4",
            "--set", "tokenizer.train.vocab_size=600", "--set", "tokenizer.train.sample_bytes=300000"]
    code = main(args)
    assert code == 0
    printed = capsys.readouterr().out
    assert "stage" in printed and "exact_dedup" in printed and "filters" in printed
    metrics = [json.loads(line) for line in (tmp_path / "out-train" / "metrics.jsonl").read_text().splitlines()]
    assert "eval_loss" in metrics[-1] and "eval" in read_manifest(out).get("splits", {})  # evaluated on the eval split
    manifest = read_manifest(out)
    assert "code" in manifest["domains"] and "prose" in manifest["domains"]
    corpus = embedded.prepare(12)
    if shutil.which("man") and embedded.MAN_ROOT.is_dir():
        pages = [json.loads(line) for line in corpus["manual"].read_text().splitlines()]
        assert 0 < len(pages) <= 12
        assert all(p["text"] and "\x08" not in p["text"] for p in pages)  # rendered, overstrike removed
        assert len({p["lang"] for p in pages}) > 1  # translated pages come first: several languages
    assert corpus["code"].parent.parent == tmp_path / "cache" / "embedded"  # under $DATAPIPE_CACHE_DIR
    # a second run with the same config finds the work done
    assert main(args) == 0


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


def test_a_users_filter_that_raises_on_ray_is_one_paragraph(tmp_path):
    """The user's path: `datapipe curate` on Ray (the default executor) with a filter of the user's own, in a file
    of the working folder, that raises on one document: exit 2, the entry, the document and its line, no stack."""
    (tmp_path / "picky.py").write_text(
        "class Picky:\n    name = 'picky'\n\n    def check(self, text):\n"
        "        if 'GROUPDEL(8)' in text:\n            raise ValueError('cannot judge this one')\n")
    corpus = REPO / "tests" / "assets" / "corpus_slice.jsonl"
    (tmp_path / "c.yaml").write_text(f"inputs: [{{path: '{corpus}', domain_field: source}}]\n"
                                     "stages: [{path: 'picky:Picky'}]\ntokenizer: {train: {vocab_size: 400}}\n")
    done = subprocess.run([sys.executable, "-m", "datapipe", "curate", "c.yaml", "--no-progress", "--output", "out"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    line = next(n for n, text in enumerate(corpus.read_text().splitlines(), 1) if "GROUPDEL(8)" in text)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"datapipe: error: stages[0]: filter 'picky' (picky:Picky), on document "
                                  f"'man/cs/man8/groupdel.8.gz' (line {line} of {corpus}): its check raised ValueError: "
                                  "cannot judge this one ("), done.stderr[-3000:]
    assert len(done.stderr.splitlines()) == 1  # one paragraph, nothing of Ray's


def test_config_reference_lists_every_section(capsys):
    assert main(["config-reference"]) == 0
    out = capsys.readouterr().out
    for key in ("inputs[].path", "read.block_bytes", "dedup.exact.enabled", "tokenizer.eos_token", "output.shard_bytes", "ray.address"):
        assert key in out


# ------------------------------------------------------------------------------------ user mistakes

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO / "tokenizers" / "quickstart" / "tokenizer.json")


def _mistake_fixtures(tmp: Path) -> dict[str, str]:
    """Small files and folders for every kind of mistake: no curation or training runs."""
    from datapipe.curation.preferences import write_preference_shards
    from datapipe.testing.shards import write_fake_shards

    docs = [[{"id": f"d{s}-{i}", "domain": "web", "tokens": [1, 2, 3, 4, 0]} for i in range(4)] for s in range(2)]
    write_fake_shards(tmp / "text", docs, vocab_size=64)
    pairs = [{"id": str(i), "domain": "preference", "prompt": [1, 2], "chosen": [3, 0], "rejected": [4, 0]} for i in range(4)]
    write_preference_shards(iter(pairs), tmp / "pref", shard_rows=4, vocab_size=64, eos_id=0, tokenizer_path=None, config={})
    (tmp / "pairs.jsonl").write_text(json.dumps({"prompt": "Hi.", "chosen": "Hello.", "rejected": "Go."}) + "\n")
    (tmp / "broken.jsonl").write_text("{not json\n")
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    (tmp / "a-file").write_text("x")
    files = {
        "bad.yaml": "inputs: [{path: x.jsonl}\noutput: {dir: o}\n",  # the ] is missing
        "curate.yaml": f"inputs: [{{path: '{tmp}/none/*.jsonl'}}]\noutput: {{dir: '{tmp}/out'}}\n",
        "train.yaml": "model: {n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}\n"
                      "data: {seq_len: 64, batch_size: 2}\ntrain: {steps: 2, device: cpu}\n",
        "prefs.yaml": f"tokenizer: '{TOKENIZER}'\ninputs: ['{tmp}/pairs.jsonl']\noutput: '{tmp}/prefs-out'\n",
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    names = {"bad": "bad.yaml", "curate": "curate.yaml", "train": "train.yaml", "prefs": "prefs.yaml", "text": "text",
             "pref": "pref", "broken": "broken.jsonl", "run": "run", "afile": "a-file", "none": "none",
             "pairs": "pairs.jsonl"}
    return {key: str(tmp / name) for key, name in names.items()}


# (argv, what the message must name); {name} is a path from _mistake_fixtures
MISTAKES = [
    (["curate", "{none}/c.yaml"], "config file not found"),
    (["curate", "{bad}"], "not valid YAML: "),
    (["curate", "{text}"], "is a folder; the config must be a YAML file"),
    (["curate", "{curate}", "--set", "output.shard_byte=10"], "unknown config key 'output.shard_byte'"),
    (["curate", "{curate}", "--set", "read.batch_size=0"], "read.batch_size must be > 0, got 0"),
    (["curate", "{curate}", "--set", "read.batch_size"], "--set expects KEY=VALUE"),
    (["curate", "{curate}", "--set", "read.batch_size=[1"], "--set read.batch_size: the value '[1' is not valid YAML"),
    (["curate", "{curate}", "--executor", "local", "--no-progress"], "none/*.jsonl"),
    (["curate-preferences", "{none}/p.yaml"], "config file not found"),
    (["curate-preferences", "{bad}"], "not valid YAML: "),
    (["curate-preferences", "{prefs}", "--set", "shard_rowz=2"], "unknown config key 'shard_rowz'"),
    (["curate-preferences", "{prefs}", "--set", "shard_rows=0"], "shard_rows must be an integer >= 1, got 0"),
    (["curate-preferences", "{prefs}", "--set", "inputs=[]"], "inputs must name at least one file"),
    (["curate-preferences", "{prefs}", "--input", "{none}/p.jsonl"], "inputs[0] '{none}/p.jsonl': no such file"),
    (["curate-preferences", "{prefs}", "--input", "{broken}"], "broken.jsonl line 1: not a JSON record"),
    (["curate-preferences", "{prefs}", "--set", "tokenizer={none}/t.json"], "tokenizer must be a tokenizer.json file"),
    (["curate-preferences", "{prefs}", "--output", "{text}"], "holds another run"),
    (["run", "--output", "{none}/r", "--set", "dedup.exact.enabeld=false"],  # the flag, not the embedded recipe's file
     "error: --set dedup.exact.enabeld=false: unknown config key 'dedup.exact.enabeld'"),
    (["curate", "{curate}", "--input", "{pairs}", "--output", "{afile}", "--executor", "local", "--no-progress"],
     "error: output.dir: '{afile}' is a file, not a folder"),
    (["curate", "{curate}", "--input", "{pairs}", "--output", "{afile}/out", "--executor", "local", "--no-progress"],
     "cannot create the folder '{afile}/out': '{afile}' is a file, not a folder"),
    (["run", "--output", "{none}/r", "--man-pages", "-3"], "--man-pages must be >= 0"),
    (["train", "{none}/t.yaml"], "config file not found"),
    (["train", "{bad}"], "not valid YAML: "),
    (["train", "{train}", "--set", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
    (["train", "{train}", "--set", "train.steps=-1"], "train.steps must be an integer >= 1, got -1"),
    (["train", "{train}", "--data", "{none}", "--output", "{none}/r"], "does not exist"),
    (["train", "{train}", "--data", "{run}", "--output", "{none}/r"], "holds no manifest.json"),
    (["train", "{train}", "--data", "{pref}", "--output", "{none}/r"], "is a preference folder"),
    (["train", "{train}", "--data", "{text}", "--output", "{none}/r", "--set", "train.objective=dpo"],
     "must be a preference folder"),
    (["train", "{train}", "--data", "{text}", "--output", "{none}/r", "--set", "model.vocab_size=10"],
     "model.vocab_size must be >= 64"),
    (["train", "{train}", "--data", "{text}", "--output", "{none}/r", "--resume"], "--resume: no checkpoint"),
    (["train", "{train}", "--data", "{text}", "--output", "{afile}"], "train.output: '{afile}' is a file, not a folder"),
    (["train"], "the following arguments are required: config"),
    (["stats", "{none}"], "does not exist"),
    (["stats", "{run}"], "holds no stats.json"),
    (["plot", "{none}"], "must hold metrics.jsonl"),
    (["plot", "{text}"], "must hold metrics.jsonl"),
    (["config-reference", "trian"], "invalid choice: 'trian'"),
]


def test_every_subcommand_answers_a_users_mistake_with_one_paragraph(tmp_path, capsys):
    paths = _mistake_fixtures(tmp_path)
    for argv, named in MISTAKES:
        argv = [a.format(**paths) for a in argv]
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code != 0, argv
        assert named.format(**paths) in err, (argv, err)
        assert "Traceback" not in err and "\n\n" not in err and err.startswith(("datapipe", "usage: datapipe")), (argv, err)
        assert len(err) < 600, (argv, err)  # a paragraph, not a dump
    assert not (tmp_path / "none").exists() and not (tmp_path / "prefs-out").exists()  # nothing was written
    # and as a real process: nothing printed outside main() either
    # (a training process: test_ctrl_c_during_training_in_a_real_process)
    done = subprocess.run([sys.executable, "-m", "datapipe", "curate-preferences", paths["bad"]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not valid YAML: " in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_run_refuses_negative_train_steps_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(embedded, "prepare", lambda n: pytest.fail("the corpus was built for a refused command"))
    assert main(["run", "--output", str(tmp_path / "r"), "--train-steps", "-1", "--executor", "local",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == "datapipe: error: --train-steps must be >= 0 (0 = curate only), got -1\n"
    assert not (tmp_path / "r").exists()


def test_ctrl_c_is_one_line_saying_how_to_resume(monkeypatch, capsys):
    from datapipe import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.HANDLERS, "curate", interrupted)
    assert main(["curate", "any.yaml"]) == 130
    assert capsys.readouterr().err == "datapipe curate: stopped (Ctrl-C); rerun the same command to resume: finished work is kept\n"


def test_ctrl_c_of_train_names_the_command_that_works_for_what_its_folder_holds(tmp_path):
    from datapipe.cli import AFTER_CTRL_C, _after_train_ctrl_c

    run = tmp_path / "run"  # stopped before training began: --resume would find nothing
    assert _after_train_ctrl_c(str(run)) == "rerun the same command to start again (nothing was trained yet)"
    run.mkdir()
    (run / "config.yaml").write_text("train: {steps: 2}\n")
    assert "--resume to start it again from step 0" in _after_train_ctrl_c(str(run))
    (run / "checkpoint.pt").write_bytes(b"")
    assert _after_train_ctrl_c(str(run)) == AFTER_CTRL_C["train"] == ("rerun the same command with --resume to "
                                                                       "continue from the last checkpoint")


def test_ctrl_c_during_training_in_a_real_process(tmp_path):
    """Stopped before its first checkpoint (the recipe writes one only at the end), the run is continued by the command
    the Ctrl-C line names: --resume starts it again from step 0, and metrics.jsonl holds each step once."""
    from datapipe.testing.shards import write_fake_shards

    docs = [[{"id": f"d{s}-{i}", "domain": "web", "tokens": list(range(1, 40)) + [0]} for i in range(8)] for s in range(2)]
    write_fake_shards(tmp_path / "text", docs, vocab_size=64)
    recipe = tmp_path / "t.yaml"
    recipe.write_text("model: {n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}\n"
                      "data: {seq_len: 64, batch_size: 2}\n"
                      "train: {steps: 1000000, log_every: 1, device: cpu, ckpt_every: 0, ckpt_minutes: 0}\n")
    command = [sys.executable, "-m", "datapipe", "train", str(recipe), "--data", str(tmp_path / "text"),
               "--output", str(tmp_path / "run")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        for line in proc.stdout:  # wait until it trains (prefetch thread running) and logged a step, then Ctrl-C
            seen += line.startswith("step")
            if seen == 2:  # step 2 printed: step 1's metrics row is written
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["datapipe train: stopped (Ctrl-C); rerun the same command with --resume to "
                                        "start it again from step 0 (no checkpoint was written yet)"], err
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and (tmp_path / "run" / "metrics.jsonl").read_text()
    # the command it names (a stop_at, an execution key, ends this one early)
    done = subprocess.run(command + ["--resume", "--set", "train.stop_at=3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--resume: {tmp_path / 'run'} stopped before its first checkpoint: starting it again from step 0" in done.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_help_describes_every_command_and_flag_and_version(capsys):
    from datapipe import __version__
    from datapipe.cli import _parser

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"datapipe {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "datapipe turns raw text into training data" in out and "The command line:" not in out
    commands = _parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"curate", "run", "config-reference", "stats", "train", "curate-preferences", "plot",
                             "experiment", "score"}
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"datapipe {name} {action.option_strings or action.dest} has no help text"


@pytest.mark.parametrize("which,key", [("train", "train.objective: 'lm' | 'dpo' = 'lm'"), ("preferences", "shard_rows: int"),
                                       ("curate", "dedup.exact.enabled: bool = True"), ("experiment", "budget.steps: int")])
def test_config_reference_of_each_command(which, key, capsys):
    assert main(["config-reference", which]) == 0
    assert key in capsys.readouterr().out


def _docs() -> dict[str, str]:
    """The user's documentation: the README and the reference pages under docs/, by name."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return {str(p.relative_to(REPO)): p.read_text() for p in pages}


def test_help_docstring_docs_and_config_reference_agree_on_commands_and_sections(capsys):
    """One source of truth: the parser's commands and `ROOTS`' sections; the texts that list them must agree:
    `--help`, the cli docstring, the README and every page of docs/."""
    import re

    from datapipe import cli

    commands = set(cli._parser()._subparsers._group_actions[0].choices)
    assert commands == set(cli.HANDLERS)
    assert set(re.findall(r"^    datapipe ([\w-]+)", cli.__doc__, re.M)) == commands  # the module's usage lines
    docs = _docs()
    assert len(docs) > 1, "docs/ holds no page"
    named = {name: set(re.findall(r"`datapipe ([a-z][\w-]*)", text)) for name, text in docs.items()}
    assert named["README.md"] == commands  # the README's tour names every command
    assert set().union(*named.values()) == commands, named  # and no page names a command that does not exist
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    sections = set(cli.ROOTS)
    texts = [("--help", help_text), ("cli docstring", cli.__doc__)] + [(n, " ".join(t.split())) for n, t in docs.items()]
    for where, text in texts:
        listed = re.findall(r"config-reference \[([\w|-]+)\]", text)
        assert all(set(entry.split("|")) == sections for entry in listed), (where, listed, sections)
        if where in docs:  # `datapipe config-reference SECTION` in the docs names a section that exists
            assert set(re.findall(r"config-reference (\w+)", text)) <= sections, where
    for where in ("--help", "cli docstring", "README.md", "docs/curation.md"):  # each lists the sections in full
        assert re.search(r"config-reference \[", dict(texts)[where]), where
    for which in sorted(sections):  # every section prints, in readable types (no module paths, no quoted markers)
        assert main(["config-reference", which]) == 0
        reference = capsys.readouterr().out
        for internal in ("datapipe.", "<class", "typing.", "'(required)'"):
            assert internal not in reference, (which, internal)
    assert main(["config-reference", "experiment"]) == 0
    reference = capsys.readouterr().out
    assert "arms: dict[str, ArmConfig] = (required)" in reference and "arms.NAME.data: str | None = None" in reference


def test_notes_say_what_the_code_does():
    """Notes that once disagreed with the code: the eval default, folder formats, the fast encoder's speed."""
    from datapipe.core.config import help_lines
    from datapipe.curation.config import CurateConfig
    from datapipe.train.config import TrainConfig

    train = "\n".join(help_lines(TrainConfig))
    assert "0 = no eval" not in train and "eval split" in train.split("data.holdout_shards")[1].splitlines()[0]
    curate = "\n".join(help_lines(CurateConfig))
    assert "a folder = text" not in curate and "hf_disk" in curate.split("inputs[].format")[1].splitlines()[0]
    benchmarks = (REPO / "BENCHMARKS.md").read_text()
    assert "13.9x with 1 worker, 7.4x with 2" in " ".join(benchmarks.split())
    encoder = curate.split("tokenizer.encoder")[1].splitlines()[0]
    curation = " ".join((REPO / "docs" / "curation.md").read_text().split())
    # the measured figure where the reference quotes it; the note points at the measurement instead of a stale copy
    assert "tokenize phase runs 7-14x faster" in curation and "7.4x" not in curation and "3.5x" not in curation
    assert "BENCHMARKS.md" in encoder and not any(c.isdigit() for c in encoder.split("'fast'")[1].split(";")[0])
    assert all("curated shards hold one domain each" not in text for text in _docs().values())

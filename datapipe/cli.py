"""The command line: parse arguments, load the config, call one function per subcommand.

    datapipe curate CONFIG [--input PATH ...] [--output DIR] [--set KEY=VALUE ...] [--ray-address ADDR]
    datapipe run [--output DIR] [--train-steps N]   # curate the embedded default corpus, train a tiny GPT, print stats
    datapipe config-reference [curate|train|preferences|experiment]   # every config key with its type, default and note
    datapipe stats OUTPUT_DIR [--plot DIR] [--html FILE] [--json] [--why ID]   # inspect a finished run
    datapipe train CONFIG [--data DIR] [--output DIR] [--set KEY=VALUE ...] [--resume]   # train a GPT on shards
    datapipe score CONFIG --data DIR --output DIR [--steps N] [--seed S] [--set KEY=VALUE ...] [--verbose]   # add ref_loss (RHO-LOSS)
    datapipe curate-preferences CONFIG [--input PATH ...] [--output DIR] [--set KEY=VALUE ...]
    datapipe plot RUN_DIR                   # loss, lr, tokens/s and data-wait of a training run, to PNG
    datapipe experiment CONFIG [--output DIR] [--set KEY=VALUE ...] [--verbose]   # arms x seeds at the same compute, compared

Every command's config goes through the one strict loader (`datapipe.core.config.load`). A user's
mistake (ConfigError, a path that cannot be read) prints one paragraph and exits 2; a run stopped on
purpose (RunStopped) exits 1; Ctrl-C prints one line saying how to resume and exits 130. No traceback.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from datapipe import __version__
from datapipe.core.config import ConfigError, RunStopped

DESCRIPTION = """\
datapipe turns raw text into training data for language models. It curates documents into
tokenized Arrow shards on Ray (exact and near dedup, language id, quality filters, tokenization,
diversity sampling and mixture reweighting), shows what every stage kept and dropped, and trains
a small GPT (next-token or DPO) on the shards with a streaming, resumable, packing loader.

Start with `datapipe run` (it needs no data), or `datapipe curate configs/quickstart.yaml`.
Every command reads a YAML recipe; `datapipe config-reference [curate|train|preferences|experiment]`
lists its keys, and `--set KEY=VALUE` overrides any of them."""

SET_HELP = "override a config key (dotted; a number indexes a list); the value is YAML, e.g. --set {}; repeatable"
EXECUTOR_HELP = "'ray' (default): Ray runs the tasks; 'local': every task runs in this process, one at a time (debugging)"
RAY_HELP = ("an existing Ray cluster ('auto' after `ray start`, or HOST:PORT); default: config ray.address, else "
            "$RAY_ADDRESS when set, else an embedded local Ray")


def _parser() -> argparse.ArgumentParser:
    """`datapipe`'s arguments: the top level's, and each command's from its `_add_*` function."""
    p = argparse.ArgumentParser(prog="datapipe", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"datapipe {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for add_command in (_add_run, _add_curate, _add_config_reference, _add_stats, _add_train, _add_score,
                        _add_curate_preferences, _add_plot, _add_experiment):  # the order `datapipe --help` lists
        add_command(sub)
    return p


def _add_execution_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how a curation runs, and what it shows: `run` and `curate` take the same."""
    parser.add_argument("--ray-address", default=None, metavar="ADDR", help=RAY_HELP)
    parser.add_argument("--executor", choices=["ray", "local"], default="ray", help=EXECUTOR_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (for logs and CI)")
    parser.add_argument("--verbose", action="store_true",
                        help="progress of every step of every stage, not one line per stage")


def _add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="the main job: curate the embedded default corpus (stdlib code, docstrings, "
                                   "man pages), train a tiny GPT on it, print the stats",
                       description="Curate a corpus built from real text on this machine (the Python standard "
                                   "library's code and docstrings, manual pages), train a tiny GPT on the shards "
                                   "and print the stage funnel. Needs no data.")
    r.add_argument("--output", default="out/run", metavar="DIR",
                   help="output folder of the curation (default: out/run); the training run goes to DIR-train")
    r.add_argument("--man-pages", type=int, default=1500, metavar="N", help="manual pages to render (default: 1500)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help=SET_HELP.format("tokenizer.train.vocab_size=4096") + " (curation keys)")
    _add_execution_arguments(r)
    r.add_argument("--train-steps", type=int, default=150, metavar="N",
                   help="steps of the tiny model trained on the result (0 = curate only; default: 150)")


def _add_curate(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("curate", help="curate raw documents into tokenized Arrow shards",
                       description="Curate raw documents into tokenized Arrow shards with a manifest and statistics. "
                                   "Rerunning the same command after a crash or Ctrl-C resumes: finished work is kept.")
    c.add_argument("config", help="a YAML recipe, e.g. configs/quickstart.yaml (keys: datapipe config-reference curate)")
    c.add_argument("--input", action="append", default=None, metavar="PATH",
                   help="a path, glob or fsspec URL of raw documents; repeatable; replaces the config's inputs. "
                        "Each takes the config's first input's options text_field, id_field, domain, glob, split, "
                        "data_files and rows_per_unit, but not its path, format (the extension decides) or "
                        "domain_field: a record's own 'domain' field names its domain (another field: "
                        "--set inputs.0.domain_field=FIELD)")
    c.add_argument("--output", default=None, metavar="DIR", help="output folder (config output.dir)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help=SET_HELP.format("dedup.exact.enabled=false"))
    _add_execution_arguments(c)


def _add_config_reference(sub: argparse._SubParsersAction) -> None:
    cr = sub.add_parser("config-reference", help="print every config key with its type, default and note",
                        description="Print every key of a config with its type, default and a one-line note.")
    cr.add_argument("which", nargs="?", choices=sorted(ROOTS), default="curate",
                    help="whose config: curate (default; also `datapipe run`), train, preferences (curate-preferences) "
                         "or experiment")


def _add_stats(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("stats", help="inspect a finished run: funnel, drop reasons, mixture, lengths; or why one document went")
    s.add_argument("output", metavar="OUTPUT_DIR", help="a curated output folder (holds stats.json and manifest.json)")
    s.add_argument("--plot", default=None, metavar="DIR", help="write funnel.png, token_share.png and lengths.png into DIR")
    s.add_argument("--html", default=None, metavar="FILE", help="write one self-contained HTML page with the tables and pictures")
    s.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    s.add_argument("--why", default=None, metavar="ID", help="say why document ID was dropped (exit 1 when the id is unknown)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train the bundled GPT on curated shards (torchrun for DDP)",
                       description="Train the bundled GPT on curated shards (train.objective lm) or preference shards "
                                   "(dpo). After a crash or Ctrl-C, the same command with --resume continues from the "
                                   "last checkpoint.")
    t.add_argument("config", help="a YAML training recipe, e.g. configs/train-tiny.yaml (keys: datapipe config-reference train)")
    t.add_argument("--data", default=None, metavar="DIR", help="curated folder to train on (config data.source)")
    t.add_argument("--output", default=None, metavar="DIR", help="run folder (config train.output)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help=SET_HELP.format("train.steps=200"))
    t.add_argument("--resume", action="store_true",
                   help="continue from RUN_DIR/checkpoint.pt with the run's own settings (RUN_DIR/config.yaml: earlier "
                        "--set need not be repeated; one given again must agree); a run stopped before its first "
                        "checkpoint starts again from step 0")


def _add_score(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("score", help="RHO-LOSS scoring pass: copy a curated folder, adding each token's "
                                      "reference-model loss (ref_loss) for `train.rho`",
                        description="Train two small reference models, one on each half of the documents (split by a "
                                    "seeded hash of the id), and write a new curated folder whose shards add ref_loss "
                                    "(a float32 list per document: each token's loss under the model of the other "
                                    "half) and ref_loss_mean (each document's mean), and whose manifest records the "
                                    "pass's FLOPs (scoring.flops). Train on it with --set train.rho.enabled=true. The "
                                    "input is never modified; rerunning the command resumes a killed pass, or does "
                                    "nothing when the output is finished.")
    sc.add_argument("config", help="a YAML training recipe for the reference models, e.g. configs/train-tiny.yaml "
                                   "(its model, optim, schedule, data.seq_len, data.batch_size apply)")
    sc.add_argument("--data", default=None, metavar="DIR", help="the curated folder to score (config data.source)")
    sc.add_argument("--output", required=True, metavar="DIR", help="the new scored folder (must not exist, or hold "
                                                                   "this same scoring)")
    sc.add_argument("--steps", type=int, default=None, metavar="N", help="training steps of each reference model "
                                                                         "(config train.steps)")
    sc.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the halves, the models and the data "
                                                                        "order (config train.seed)")
    sc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help=SET_HELP.format("model.n_layer=1") + " (training keys)")
    sc.add_argument("--verbose", action="store_true",
                    help="the reference models' trainer lines (every log step) and a line per scored shard, not one "
                         "line per model")


def _add_curate_preferences(sub: argparse._SubParsersAction) -> None:
    cp = sub.add_parser("curate-preferences", help="tokenize prompt/chosen/rejected records into preference shards",
                        description="Tokenize prompt/chosen/rejected records (JSONL, Parquet, Hugging Face datasets) "
                                    "into preference shards for DPO.")
    cp.add_argument("config", help="a YAML recipe, e.g. configs/preferences.yaml (keys: datapipe config-reference preferences)")
    cp.add_argument("--input", action="append", default=None, metavar="PATH",
                    help="a file or glob of preference records (a dataset name with format hf); repeatable; "
                         "replaces the config's inputs")
    cp.add_argument("--output", default=None, metavar="DIR", help="output folder (config output)")
    cp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help=SET_HELP.format("max_prompt_tokens=128"))


def _add_plot(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plot", help="draw loss (train and eval), lr, tokens/s and data-wait of a run to PNG")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a training run folder (holds metrics.jsonl); writes RUN_DIR/training.png")


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("experiment", help="run arms x seeds of the trainer at the same compute; compare eval loss and "
                                           "tokens to a target",
                        description="Train every arm of an experiment once per seed with the same steps, batch and "
                                    "sequence length, evaluate all on one eval set, and write OUTPUT/results.json "
                                    "and OUTPUT/results.png. Rerunning the command reads finished cells back and "
                                    "resumes a killed one from its last checkpoint.")
    ex.add_argument("config", help="an experiment YAML, e.g. configs/experiment-tiny.yaml (keys: datapipe "
                                   "config-reference experiment)")
    ex.add_argument("--output", default=None, metavar="DIR", help="output folder (config output)")
    ex.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help=SET_HELP.format("budget.steps=500") + " (experiment keys)")
    ex.add_argument("--verbose", action="store_true",
                    help="every cell's trainer lines (every log step), not one line per cell")


def cmd_experiment(args: argparse.Namespace) -> int:
    from datapipe.inspect.experiment_plot import plot_experiment
    from datapipe.train.experiment import load_experiment_config, run_experiment

    t_start = time.perf_counter()
    exp = load_experiment_config(args.config, args.overrides, output=args.output)
    results = run_experiment(exp, verbose=args.verbose)
    for name, arm in results["arms"].items():
        reach, ratio = arm["tokens_to_target"], arm["ratio_to_baseline"]["of_means"]
        print(f"{name}: final eval loss {arm['final_eval_loss']['mean']:.4f} ± {arm['final_eval_loss']['std']:.4f}; "
              f"tokens to {results['target']:.4f}: " + ("never reached" if reach["mean"] is None else
                                                        f"{reach['mean']:,.0f} ± {reach['std']:,.0f} ({reach['n']}/{reach['of']} seeds)")
              + (f", x{ratio:.2f} the baseline" if ratio is not None else ""))
    plot = plot_experiment(Path(exp.output) / "results.json")
    print(f"experiment: {_count(len(exp.arms) * len(exp.seeds), 'cell')} done ({_count(len(exp.arms), 'arm')} x "
          f"{_count(len(exp.seeds), 'seed')}) in {time.perf_counter() - t_start:.1f} s; results "
          f"{Path(exp.output) / 'results.json'}, plot {plot}")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


def cmd_train(args: argparse.Namespace) -> int:
    from datapipe.train.config import check_sources, load_train_config
    from datapipe.train.loop import resumed_config, train

    from datapipe.curation.preferences import default_preference_set

    cfg = load_train_config(args.config, args.overrides, data=args.data, output=args.output)
    if args.resume:  # the run's own settings; what this command line sets again must agree with them
        given = {o.split("=", 1)[0].strip(): f"--set {o.strip()}" for o in args.overrides}
        if args.data is not None:
            given["data.source"] = f"--data {args.data}"
        cfg = resumed_config(cfg, given)
    args.run_dir = cfg.train.output  # for the Ctrl-C line: what a rerun can do depends on what the folder holds
    check_sources(cfg)
    train(cfg, resume=args.resume, default_preferences=default_preference_set)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from datapipe.core.config import load
    from datapipe.train.config import TrainConfig
    from datapipe.train.reference import score

    cfg = load(TrainConfig, args.config, args.overrides,
               {"data.source": args.data, "train.steps": args.steps, "train.seed": args.seed})
    score(cfg, args.output, verbose=args.verbose)
    return 0


def cmd_curate_preferences(args: argparse.Namespace) -> int:
    from datapipe.core.config import load
    from datapipe.curation.preferences import PreferenceConfig, curate_preferences

    cfg = load(PreferenceConfig, args.config, args.overrides, {"inputs": args.input, "output": args.output})
    m = curate_preferences(cfg)
    print(f"{m['num_shards']} shards, {m['total_docs']:,} pairs, {m['total_tokens']:,} tokens -> {cfg.output}/manifest.json")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from datapipe.inspect.plots import plot_run

    print(f"wrote {plot_run(args.run_dir)}")
    return 0


def cmd_curate(args: argparse.Namespace) -> int:
    from datapipe.curation.config import load_config
    from datapipe import curate

    cfg = load_config(args.config, args.overrides, inputs=args.input, output=args.output, ray_address=args.ray_address)
    _report(curate(cfg, executor=_executor(args), progress=not args.no_progress, verbose=args.verbose))
    return 0


def _executor(args: argparse.Namespace):
    """None lets the run start Ray from the config; 'local' runs in this process."""
    if args.executor != "local":
        return None
    from datapipe.curation.executors import make_executor

    return make_executor("local", None, num_cpus=None, max_retries=0, progress=args.verbose and not args.no_progress)


def _report(result) -> None:
    from datapipe.inspect.report import format_funnel

    print(format_funnel(result.stats, result.manifest))  # its written table adds up to the manifest's totals
    m = result.manifest
    print(f"\n{m['num_shards']} shards, {m['total_docs']:,} documents, {m['total_tokens']:,} tokens "
          f"-> {Path(result.out_dir) / 'manifest.json'} ({result.seconds:.1f} s)")


def cmd_run(args: argparse.Namespace) -> int:
    from datapipe.curation import embedded
    from datapipe.curation.config import load_config

    recipe = Path(__file__).parent / "curation" / "recipes" / "embedded.yaml"

    def run_config(paths: dict[str, Path]):
        inputs_override = f"inputs=[{', '.join(_input_yaml(d, p) for d, p in paths.items())}]"
        return load_config(recipe, [inputs_override, *args.overrides], output=args.output, ray_address=args.ray_address)

    if args.man_pages < 0:
        raise ConfigError(f"--man-pages must be >= 0, got {args.man_pages}")
    if args.train_steps < 0:
        raise ConfigError(f"--train-steps must be >= 0 (0 = curate only), got {args.train_steps}")
    if args.train_steps > 0 and "://" in args.output and not args.output.startswith("file://"):
        raise ConfigError(f"--output: {args.output!r} is a URL, but `datapipe run` trains next to it (DIR-train), "
                          "which must be a local folder; give a local --output, or --train-steps 0 to only curate")
    run_config({"code": Path("code.jsonl")})  # --set checked before the corpus is built (minutes, the first time)
    cfg = run_config(embedded.prepare(args.man_pages))
    from datapipe import curate

    result = curate(cfg, executor=_executor(args), progress=not args.no_progress, verbose=args.verbose)
    if args.train_steps <= 0:
        _report(result)
    else:  # train the tiny model on what was just curated, then show the full stats
        from datapipe.inspect import stats
        from datapipe.train.config import load_train_config
        from datapipe.train.loop import has_run, train

        recipe = Path(__file__).resolve().parents[1] / "configs" / "train-tiny.yaml"
        steps = args.train_steps
        run_dir = Path(args.output).with_name(Path(args.output).name + "-train")
        tcfg = load_train_config(recipe if recipe.exists() else None,
                                 [f"train.steps={steps}", f"train.eval_every={max(steps // 2, 1)}",
                                  f"train.ckpt_every={steps}", "data.holdout_shards=0"],  # eval: the run's eval split
                                 data=args.output, output=str(run_dir))
        if result.reused and _finished_training(run_dir, steps):  # new shards: `train` checks the run against them
            print(f"\n{run_dir} is a finished training run of {steps} steps: reusing it (nothing to train)")
        else:
            print(f"\ntraining a tiny GPT for {steps} steps on {args.output} -> {tcfg.train.output}")
            train(tcfg, resume=has_run(run_dir))  # a rerun continues the run (or names what differs)
        from datapipe.inspect.plots import plot_run

        print(f"wrote {plot_run(tcfg.train.output)}\n")
        print(stats.render_text(stats.collect(args.output)))
    return 0


def _finished_training(run_dir: Path, steps: int) -> bool:
    """Whether `run_dir` holds a training run that reached exactly `steps` steps (another count: `train`
    resumes it, or refuses naming the differing key)."""
    from datapipe.train.checkpoint import load_checkpoint

    ckpt = run_dir / "checkpoint.pt"
    return ckpt.exists() and int(load_checkpoint(ckpt, what="datapipe run")["step"]) == steps


def _input_yaml(domain: str, path: Path) -> str:
    return "{path: '%s', format: jsonl, domain: %s, domain_field: null}" % (str(path).replace("'", "''"), domain)


def _curate_root() -> type:
    from datapipe.curation.config import CurateConfig

    return CurateConfig


def _train_root() -> type:
    from datapipe.train.config import TrainConfig

    return TrainConfig


def _preferences_root() -> type:
    from datapipe.curation.preferences import PreferenceConfig

    return PreferenceConfig


def _experiment_root() -> type:
    from datapipe.train.experiment import ExperimentConfig

    return ExperimentConfig


# The config root of each command, by the name `config-reference` takes (imported lazily: torch is slow to load).
ROOTS = {"curate": _curate_root, "train": _train_root, "preferences": _preferences_root, "experiment": _experiment_root}


def cmd_config_reference(args: argparse.Namespace) -> int:
    from datapipe.core.config import help_lines

    print("\n".join(help_lines(ROOTS[args.which]())))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    import json

    from datapipe.inspect import stats

    if args.why is not None:
        info = stats.why(args.output, args.why)
        print(json.dumps(info, indent=1) if args.json else stats.render_why(info, args.why))
        return 0 if info is not None else 1
    figures = stats.collect(args.output)
    images = stats.plot(figures, args.output, args.plot) if args.plot else None
    if args.html:
        page = stats.render_html(figures, images)
        Path(args.html).parent.mkdir(parents=True, exist_ok=True)
        Path(args.html).write_text(page)
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    print(stats.render_text(figures))
    for path in (images or []) + ([Path(args.html)] if args.html else []):
        print(f"wrote {path}")
    return 0


HANDLERS = {"curate": cmd_curate, "run": cmd_run, "config-reference": cmd_config_reference, "stats": cmd_stats,
            "train": cmd_train, "plot": cmd_plot, "curate-preferences": cmd_curate_preferences,
            "experiment": cmd_experiment, "score": cmd_score}

# What Ctrl-C leaves behind, per command: how to carry on.
AFTER_CTRL_C = {
    "curate": "rerun the same command to resume: finished work is kept",
    "run": "rerun the same command to resume: finished curation work is kept, and the tiny model's training resumes",
    "train": "rerun the same command with --resume to continue from the last checkpoint",
    "curate-preferences": "rerun the same command to curate the preference records again",
    "experiment": "rerun the same command to continue: finished cells are kept, a killed one resumes from its checkpoint",
    "score": "rerun the same command to resume: finished reference models are kept, a killed one resumes from its checkpoint",
}


def _after_train_ctrl_c(run_dir: str) -> str:
    """How to carry on a `datapipe train` stopped by Ctrl-C: the printed command must work for what the folder holds."""
    from datapipe.train.loop import has_run

    if not has_run(Path(run_dir)):  # stopped before training began: nothing to resume
        return "rerun the same command to start again (nothing was trained yet)"
    if (Path(run_dir) / "checkpoint.pt").exists() or (Path(run_dir) / "checkpoint.prev.pt").exists():
        return AFTER_CTRL_C["train"]
    return "rerun the same command with --resume to start it again from step 0 (no checkpoint was written yet)"


def _say(message: str) -> None:
    """One paragraph on stderr: blank lines removed."""
    print("\n".join(line for line in f"datapipe: error: {message}".splitlines() if line.strip()), file=sys.stderr)


def _os_error(exc: OSError) -> str:
    if exc.strerror and exc.filename is not None:  # '[Errno 2] No such file...' reads worse than this
        return f"{exc.strerror}: {exc.filename!r}" + (f" -> {exc.filename2!r}" if exc.filename2 else "")
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return HANDLERS[args.command](args)
    except ConfigError as exc:  # a user's mistake: say what and where, no traceback
        _say(str(exc))
        return 2
    except RunStopped as exc:
        _say(str(exc))
        return 1
    except KeyboardInterrupt:
        after = _after_train_ctrl_c(args.run_dir) if getattr(args, "run_dir", None) else AFTER_CTRL_C.get(args.command)
        print(f"datapipe {args.command}: stopped (Ctrl-C)" + (f"; {after}" if after else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # `datapipe config-reference | head`: the reader left; say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a path that cannot be read or written: a missing file, a file where a folder goes
        _say(_os_error(exc))
        return 2


def exit_process(code: int) -> NoReturn:
    """End the process with `code` once Python's exit handlers have run and stdout and stderr are flushed, without
    tearing the interpreter down: after a run that teardown (every module's objects freed one by one: Ray's,
    pyarrow's, pandas', numba's) costs CPU (BENCHMARKS.md) and does nothing for the run, whose files are written and
    closed. While a thread that Python's exit would wait for still runs, the usual exit instead."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    atexit._run_exitfuncs()  # what Python's exit runs first (logging's flush and close, Ray's shutdown)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)


def run() -> NoReturn:
    """The `datapipe` command: `main` on the command line's arguments, then `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    run()

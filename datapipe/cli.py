"""The command line: parse arguments, load the config, call one function per subcommand.

    datapipe curate CONFIG [--input PATH ...] [--output DIR] [--set KEY=VALUE ...] [--ray-address ADDR]
    datapipe run [--output DIR] [--train-steps N]   # curate the embedded default corpus, train a tiny GPT, print stats
    datapipe config-reference               # every config key with its type, default and note
    datapipe stats OUTPUT_DIR [--plot DIR] [--html FILE] [--json] [--why ID]   # inspect a finished run
    datapipe train CONFIG [--data DIR] [--output DIR] [--set KEY=VALUE ...] [--resume]   # train a GPT on shards
    datapipe plot RUN_DIR                   # loss, lr, tokens/s and data-wait of a training run, to PNG
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from datapipe.core.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datapipe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("curate", help="curate raw documents into tokenized Arrow shards")
    c.add_argument("config", help="a YAML recipe, e.g. configs/quickstart.yaml")
    c.add_argument("--input", action="append", default=None, metavar="PATH",
                   help="a path, glob or fsspec URL; repeatable; replaces the config's inputs")
    c.add_argument("--output", default=None, metavar="DIR", help="output folder (config output.dir)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config key, e.g. --set dedup.exact.enabled=false; repeatable")
    c.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster ('auto' after `ray start`); default: embedded local Ray")
    c.add_argument("--executor", choices=["ray", "local"], default="ray",
                   help="'local' runs every task in this process (debugging)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")

    r = sub.add_parser("run", help="the main job on the embedded default corpus (stdlib code, docstrings, man pages)")
    r.add_argument("--output", default="out/run", metavar="DIR", help="output folder (default: out/run)")
    r.add_argument("--man-pages", type=int, default=1500, help="manual pages to render (default: 1500)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    r.add_argument("--ray-address", default=None, metavar="ADDR")
    r.add_argument("--executor", choices=["ray", "local"], default="ray")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--train-steps", type=int, default=150, metavar="N",
                   help="steps of the tiny model trained on the result (0 = curate only; default: 150)")

    sub.add_parser("config-reference", help="print every config key with its type, default and note")

    s = sub.add_parser("stats", help="inspect a finished run: funnel, drop reasons, mixture, lengths; or why one document went")
    s.add_argument("output", metavar="OUTPUT_DIR", help="a curated output folder (holds stats.json and manifest.json)")
    s.add_argument("--plot", default=None, metavar="DIR", help="write funnel.png, token_share.png and lengths.png into DIR")
    s.add_argument("--html", default=None, metavar="FILE", help="write one self-contained HTML page with the tables and pictures")
    s.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    s.add_argument("--why", default=None, metavar="ID", help="say why document ID was dropped (exit 1 when the id is unknown)")

    t = sub.add_parser("train", help="train the bundled GPT on curated shards (torchrun for DDP)")
    t.add_argument("config", help="a YAML training recipe, e.g. configs/train-tiny.yaml")
    t.add_argument("--data", default=None, metavar="DIR", help="curated folder to train on (config data.source)")
    t.add_argument("--output", default=None, metavar="DIR", help="run folder (config train.output)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config key, e.g. --set train.steps=200; repeatable")
    t.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoint.pt")

    cp = sub.add_parser("curate-preferences", help="tokenize prompt/chosen/rejected records into preference shards")
    cp.add_argument("config", help="a YAML recipe, e.g. configs/preferences.yaml (keys: datapipe/preference.py)")
    cp.add_argument("--input", action="append", default=None, metavar="PATH", help="replaces the config's inputs; repeatable")
    cp.add_argument("--output", default=None, metavar="DIR", help="output folder (config output)")
    cp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")

    pl = sub.add_parser("plot", help="draw loss (train and eval), lr, tokens/s and data-wait of a run to PNG")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a training run folder (holds metrics.jsonl)")
    return p


def cmd_train(args: argparse.Namespace) -> int:
    from datapipe.train.config import load_train_config
    from datapipe.train.loop import train

    from datapipe.curate.preferences import default_preference_set

    cfg = load_train_config(args.config, args.overrides, data=args.data, output=args.output)
    train(cfg, resume=args.resume, default_preferences=default_preference_set)
    return 0


def cmd_curate_preferences(args: argparse.Namespace) -> int:
    import yaml

    from datapipe.core.config import apply_override, from_dict
    from datapipe.curate.preferences import PreferenceConfig, curate_preferences

    try:
        raw = yaml.safe_load(Path(args.config).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {args.config}") from None
    for assignment in args.overrides:
        apply_override(raw, assignment)
    if args.input:
        raw["inputs"] = args.input
    if args.output:
        raw["output"] = args.output
    try:
        cfg = from_dict(PreferenceConfig, raw)
    except ConfigError as exc:
        raise ConfigError(f"{args.config}: {exc}") from None
    m = curate_preferences(cfg)
    print(f"{m['num_shards']} shards, {m['total_docs']:,} pairs, {m['total_tokens']:,} tokens -> {cfg.output}/manifest.json")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from datapipe.inspect.plots import plot_run

    print(f"wrote {plot_run(args.run_dir)}")
    return 0


def cmd_curate(args: argparse.Namespace) -> int:
    from datapipe.curate.config import load_config
    from datapipe.curate.runner import curate

    cfg = load_config(args.config, args.overrides, inputs=args.input, output=args.output, ray_address=args.ray_address)
    _report(curate(cfg, executor=_executor(args), progress=not args.no_progress))
    return 0


def _executor(args: argparse.Namespace):
    """None lets the runner start Ray from the config; 'local' runs in this process."""
    if args.executor != "local":
        return None
    from datapipe.curate.executors import make_executor

    return make_executor("local", None, num_cpus=None, max_retries=0, progress=not args.no_progress)


def _report(result) -> None:
    from datapipe.inspect.report import format_funnel

    print(format_funnel(result.stats))
    m = result.manifest
    print(f"\n{m['num_shards']} shards, {m['total_docs']:,} documents, {m['total_tokens']:,} tokens "
          f"-> {Path(result.out_dir) / 'manifest.json'} ({result.seconds:.1f} s)")


def cmd_run(args: argparse.Namespace) -> int:
    from datapipe.curate import embedded
    from datapipe.curate.config import load_config

    paths = embedded.prepare(args.man_pages)
    recipe = Path(__file__).parent / "curate" / "recipes" / "embedded.yaml"
    inputs_override = [f"inputs=[{', '.join(_input_yaml(d, p) for d, p in paths.items())}]"]
    cfg = load_config(recipe, inputs_override + args.overrides, output=args.output, ray_address=args.ray_address)
    from datapipe.curate.runner import curate

    result = curate(cfg, executor=_executor(args), progress=not args.no_progress)
    if args.train_steps <= 0:
        _report(result)
    else:  # train the tiny model on what was just curated, then show the full stats
        from datapipe.core import shards
        from datapipe.inspect import stats
        from datapipe.train.config import load_train_config
        from datapipe.train.loop import train

        recipe = Path(__file__).resolve().parents[1] / "configs" / "train-tiny.yaml"
        steps = args.train_steps
        holdout = 1 if shards.read_manifest(args.output)["num_shards"] >= 2 else 0  # the last shard, for eval
        run_dir = Path(args.output).with_name(Path(args.output).name + "-train")
        tcfg = load_train_config(recipe if recipe.exists() else None,
                                 [f"train.steps={steps}", f"train.eval_every={max(steps // 2, 1)}",
                                  f"train.ckpt_every={steps}", f"data.holdout_shards={holdout}"],
                                 data=args.output, output=str(run_dir))
        print(f"\ntraining a tiny GPT for {steps} steps on {args.output} -> {tcfg.train.output}")
        train(tcfg)
        from datapipe.inspect.plots import plot_run

        print(f"wrote {plot_run(tcfg.train.output)}\n")
        print(stats.render_text(stats.collect(args.output)))
    return 0


def _input_yaml(domain: str, path: Path) -> str:
    return "{path: '%s', format: jsonl, domain: %s, domain_field: null}" % (str(path).replace("'", "''"), domain)


def cmd_config_reference(_: argparse.Namespace) -> int:
    from datapipe.curate.config import CurateConfig
    from datapipe.core.config import help_lines

    print("\n".join(help_lines(CurateConfig)))
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"curate": cmd_curate, "run": cmd_run, "config-reference": cmd_config_reference,
               "stats": cmd_stats, "train": cmd_train, "plot": cmd_plot,
               "curate-preferences": cmd_curate_preferences}[args.command]
    try:
        return handler(args)
    except (ConfigError, FileNotFoundError) as exc:  # bad input: a clear message, no traceback
        print(f"datapipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

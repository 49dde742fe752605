"""Markdown tables of a `datapipe experiment` results.json: what BENCHMARKS.md prints for each experiment.

    python -m scripts.experiment_table runs/prioritization/experiment/results.json

Per arm: the final eval loss under the runs' weighting (token-weighted over the eval split, or data.eval_target's
mixture), the plain mean of the domains, and the token-weighted loss on each extra eval set, mean ± std over seeds;
compute per cell (FLOPs, and with the scoring pass); then per target (the baseline's mean eval loss at 50/75/100% of
its budget) the ratio to the baseline of the tokens and of the FLOPs (with the scoring pass) to reach it: point (the
geometric mean of the per-seed ratios) [95% t-interval], how the point reads (estimate, or a bound when seeds never
reach it) and the seeds that reach it; and the tokens read to reach it (every row the loader delivered: RHO-LOSS
reads candidate rows it does not train on), mean over the seeds that reach it (how many of how many).

    python -m scripts.experiment_table runs/prioritization/experiment/results.json \
        --config runs/prioritization/experiment.yaml --weights man=0.640,code=0.355,license=0.005

With `--weights` (and the experiment's config), every evaluation of every cell is re-weighted from its per-domain
losses (metrics.jsonl's `eval_domains`) to that target mixture (e.g. the training pool's token shares, where the
eval split's per-domain cap over-weights a small domain) and the whole summary is recomputed (`summarize`): the
same targets, crossings, ratios and intervals under the other weighting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _pm(spread: dict[str, Any] | None, digits: int = 3) -> str:
    if not spread or spread.get("mean") is None:
        return "—"
    return f"{spread['mean']:.{digits}f} ± {spread['std']:.{digits}f}"


def _ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "—"
    ci = r.get("ci95")
    reads = {"estimate": "", "lower_bound": " ≥", "upper_bound": " ≤", "censored_both": " ~", "baseline": ""}[r["point_is"]]
    interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    reached = r["reached"]
    return f"{reads.strip()}{r['point']:.2f}{interval} ({reached['arm']}/{reached['of']})".strip()


def _read(entry: dict[str, Any] | None) -> str:
    spread = (entry or {}).get("spread") or {}
    if spread.get("mean") is None:
        return "—"
    return f"{spread['mean']:.3g} ({spread['n']}/{spread['of']})"


def reweighted(results: dict[str, Any], config: str, weights: dict[str, float]) -> dict[str, Any]:
    """The summary recomputed with every cell's eval losses re-weighted to `weights` (normalized over the domains an
    evaluation has)."""
    from datapipe.train.experiment import load_experiment_config, summarize

    exp = load_experiment_config(config)
    curves: dict[str, dict[int, list[tuple]]] = {}
    compute: dict[str, dict[int, dict[str, Any]]] = {}
    for arm, a in results["arms"].items():
        for seed, cell in a["seeds"].items():
            grid = set(cell["curve"]["tokens"])
            by_tokens = {}
            for line in Path(cell["run_dir"], "metrics.jsonl").read_text().splitlines():
                record = json.loads(line) if line.strip() else {}
                if "eval_domains" in record and record.get("tokens") in grid:
                    losses = {d: v["loss"] for d, v in record["eval_domains"].items() if v.get("loss") is not None}
                    mass = sum(weights.get(d, 0.0) for d in losses)
                    loss = sum(weights.get(d, 0.0) * v for d, v in losses.items()) / mass
                    by_tokens[record["tokens"]] = (record["tokens"], loss, record.get("flops"))
            curves.setdefault(arm, {})[int(seed)] = [by_tokens[t] for t in sorted(by_tokens)]
            compute.setdefault(arm, {})[int(seed)] = cell.get("compute", {})
    scoring = {arm: a.get("scoring_flops", 0.0) for arm, a in results["arms"].items()}
    out = summarize(exp, curves, None, None, compute, scoring)
    out["eval_weighting"] = "reweighted to " + ", ".join(f"{d} {w:g}" for d, w in weights.items())
    return out


def tables(results: dict[str, Any]) -> str:
    arms = results["arms"]
    sets = sorted({name for a in arms.values() for name in a.get("final_by_eval_set", {})})
    lines = [f"eval weighting: {results.get('eval_weighting')}; seeds {results['seeds']}; baseline `{results['baseline']}`", ""]
    head = ["arm", f"final eval loss ({results.get('eval_weighting')})", "eval loss, domain mean"] + [f"{s}: token-weighted" for s in sets if s != "eval"]
    head += ["FLOPs a cell", "with the scoring pass"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in arms.items():
        fb = a.get("final_by_eval_set", {})
        ev = fb.get("eval", {})
        row = [name, _pm(a.get("final_eval_loss")), _pm(ev.get("loss_domain_mean"))]  # the weighting the header names
        row += [_pm(fb[s].get("loss_tokens") or fb[s].get("loss")) for s in sets if s != "eval"]
        comp = a.get("compute", {})
        g = lambda k: (f"{comp[k]['mean']:.3g}" if comp.get(k, {}).get("mean") is not None else "—")  # noqa: E731
        row += [g("flops"), g("flops_with_scoring")]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    domains = sorted({d for a in arms.values() for d in a.get("final_by_eval_set", {}).get("eval", {}).get("domains", {})})
    if domains:
        lines += ["| arm | " + " | ".join(f"eval: {d}" for d in domains) + " |", "|" + "---|" * (len(domains) + 1)]
        for name, a in arms.items():
            dom = a["final_by_eval_set"]["eval"]["domains"]
            lines.append(f"| {name} | " + " | ".join(_pm(dom.get(d)) for d in domains) + " |")
        tokens = arms[results["baseline"]]["final_by_eval_set"]["eval"].get("domain_tokens") or {}
        if tokens:
            lines.append("")
            lines.append("eval tokens per domain: " + ", ".join(f"{d} {n:,}" for d, n in sorted(tokens.items())))
        lines.append("")
    order = {"baseline_50pct": 0, "baseline_75pct": 1, "baseline_100pct": 2}
    for tname, t in sorted(results.get("targets", {}).items(), key=lambda kv: order.get(kv[0], 3)):
        lines += [f"target `{tname}`: eval loss {t['loss']:.4f} ({t['from'].split(' (')[0]})", "",
                  ("| arm | tokens to target, vs baseline | FLOPs to target, vs baseline | FLOPs with scoring, vs baseline "
                   "| tokens read to target |"),
                  "|---|---|---|---|---|"]
        for name, a in arms.items():
            r = a["targets"][tname]["ratio_to_baseline"]
            lines.append(f"| {name} | {_ratio(r.get('tokens'))} | {_ratio(r.get('flops'))} | {_ratio(r.get('flops_with_scoring'))} "
                         f"| {_read(a['targets'][tname].get('tokens_read'))} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="an experiment's results.json")
    parser.add_argument("--config", help="the experiment's YAML (needed with --weights)")
    parser.add_argument("--weights", help="a target mixture to re-weight every evaluation to, e.g. man=0.64,code=0.355,license=0.005")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    if args.weights:
        if not args.config:
            parser.error("--weights needs --config (the experiment's YAML)")
        weights = {k: float(v) for k, v in (item.split("=") for item in args.weights.split(","))}
        results = reweighted(results, args.config, weights)
    print(tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

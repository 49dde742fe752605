"""How many pools the second selection experiment needs: 80% power to show a 20% saving, from the measured A/A spread.

    python -m scripts.selection_power                     # the pre-registered count, from benchmarks/selection_first_experiment_aa.json
    python -m scripts.selection_power --sd 0.2            # another spread

The unit of replication is the pool; the statistic is the mean over pools of log(arm's FLOPs to the target / the
reference arm's), with a two-sided 95% t-interval. The spread of one pool's log ratio between two arms that differ
only by chance is the A/A arm's: the sample standard deviation of its per-pool log ratios. With n pools and a true
ratio r, the interval's upper bound falls below `bound` when T = (mean - log bound) / (s / sqrt n) < -t(0.975, n - 1),
T noncentral t with df n - 1 and noncentrality (log r - log bound) sqrt(n) / sd: that probability is the power.
The default spread is the first experiment's (small pools, code-share sampling noise); the within-domain experiment's
final count comes from its own A/A spread on its primary target (`scripts.analyze_selection.final_pool_count`, the
same `pools_needed`). `pays` (point <= 0.8 as well as upper bound < 0.9) is also given, by simulation: at a true ratio of exactly 0.8 the
point condition holds about half the time whatever n, so the rule's own pass rate is reported beside the power.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import scipy.stats

AA_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "selection_first_experiment_aa.json"
TRUE_RATIO, BOUND, POINT, POWER, LEVEL = 0.8, 0.9, 0.8, 0.8, 0.95


def aa_spread(path: Path = AA_RESULTS) -> float:
    """The sample standard deviation (ddof 1) of the A/A arm's per-pool log ratios."""
    ratios = list(json.loads(path.read_text())["pools"].values())
    return float(np.std(np.log(ratios), ddof=1))


def power(n: int, sd: float, true_ratio: float = TRUE_RATIO, bound: float = BOUND, level: float = LEVEL) -> float:
    """P(the t-interval's upper bound over n pools < bound) when the true ratio is `true_ratio`, per-pool sd `sd`."""
    critical = scipy.stats.t.ppf(0.5 + level / 2, n - 1)
    noncentrality = (math.log(true_ratio) - math.log(bound)) * math.sqrt(n) / sd
    return float(scipy.stats.nct.cdf(-critical, n - 1, noncentrality))


def pays_rate(n: int, sd: float, true_ratio: float = TRUE_RATIO, draws: int = 200_000, seed: int = 0) -> float:
    """P(point <= POINT and upper bound < BOUND) by simulation of n normal per-pool log ratios."""
    x = np.random.default_rng(seed).normal(math.log(true_ratio), sd, size=(draws, n))
    mean, s = x.mean(1), x.std(1, ddof=1)
    upper = mean + scipy.stats.t.ppf(0.5 + LEVEL / 2, n - 1) * s / math.sqrt(n)
    return float(np.mean((mean <= math.log(POINT)) & (upper < math.log(BOUND))))


def pools_needed(sd: float, target_power: float = POWER) -> int:
    """The fewest pools (at least 2) whose power reaches `target_power`."""
    n = 2
    if sd <= 0:  # no spread: two pools show any true difference
        return n
    while power(n, sd) < target_power:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sd", type=float, default=None, help="per-pool sd of the log ratio (default: the A/A spread)")
    args = parser.parse_args(argv)
    sd = args.sd if args.sd is not None else aa_spread()
    n = pools_needed(sd)
    print(json.dumps({"sd_log_ratio": round(sd, 4), "true_ratio": TRUE_RATIO, "bound": BOUND, "pools": n,
                      "power": round(power(n, sd), 3), "pays_rate_at_true_ratio": round(pays_rate(n, sd), 3),
                      "power_at_8_pools": round(power(8, sd), 3), "pays_rate_at_8_pools": round(pays_rate(8, sd), 3),
                      "pays_rate_at_0.7": round(pays_rate(n, sd, 0.7), 3)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The run's stage list: the shipped stages and a user's in pipeline order, cut into segments after each global stage
(`Plan.segments`; `phases/segment.py` runs them)."""

from __future__ import annotations

from typing import Any

from datapipe.curation.config import CurateConfig
from datapipe.curation.phases.near_dedup import NearDedupStage
from datapipe.curation.plan import Segment, stage_title
from datapipe.curation.user_stages import build_user_stages, check_extra_stages
from stages.base import GLOBAL_STAGES, FilterStage, GlobalStage, ResolvingStage, Stage
from stages.exact_dedup import ExactDedupStage
from stages.langid import LangIdStage
from stages.quality import build_filters


def build_segments(cfg: CurateConfig, extra_stages: list[Stage | GlobalStage | ResolvingStage] = ()) -> list[Segment]:
    """The stage list in pipeline order, cut after each global stage: the recipe's own `stages` and then
    `extra_stages` run after the shipped filters, before near dedup."""
    per_domain, default = build_filters(cfg.filters)
    pipeline: list[Any] = []  # normalize runs in the read task (`Plan.read_stages`): it rewrites the text
    if cfg.dedup.exact.enabled:
        pipeline.append(ExactDedupStage(cfg.dedup.exact))
    if cfg.langid.enabled:
        pipeline.append(LangIdStage(cfg.langid, keep_text=cfg.output.keep_dropped_text))
    pipeline.append(FilterStage(per_domain, default, keep_text=cfg.output.keep_dropped_text))
    pipeline += build_user_stages(cfg.stages, keep_text=cfg.output.keep_dropped_text)  # the recipe's `stages`
    pipeline += check_extra_stages(extra_stages, {s.name for s in pipeline}, keep_text=cfg.output.keep_dropped_text)
    if cfg.dedup.minhash.enabled:
        pipeline.append(NearDedupStage(cfg.dedup.minhash))
    segments = [Segment("seg0", [])]
    for stage in pipeline:
        if isinstance(stage, GLOBAL_STAGES):  # a global stage closes its segment
            segments[-1].global_stage = stage
            segments.append(Segment(f"seg{len(segments)}", []))
        else:
            segments[-1].stages.append(stage)
    for previous, seg in zip([None, *segments], segments):
        # By the stages' own names, as in stats.json's funnel: "filters+minhash" (its global stage's
        # keys are computed here), or "minhash drop" for a segment that only drops a global stage's losers.
        names = [s.name for s in seg.stages] + ([seg.global_stage.name] if seg.global_stage else [])
        seg.title = "+".join(names) if names else f"{previous.global_stage.name} drop" if previous else "copy"
        shown = [stage_title(s.name) for s in seg.stages] or [stage_title(names[0])] if names else []
        seg.stage = " + ".join(shown) if shown else stage_title(previous.global_stage.name) if previous else "copy"
    return segments

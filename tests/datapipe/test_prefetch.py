"""The prefetcher: same batches in the same order, the state of each batch, and honest wait accounting."""

from __future__ import annotations

import time

import pytest
import torch

from datapipe.train.prefetch import Prefetcher


class SlowSource:
    """n batches; each read takes `delay` seconds; `reads` counts batches read (the 'loader state')."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay, self.reads = n, delay, 0

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.delay)
            self.reads += 1
            yield {"input_ids": torch.full((2, 4), i), "doc_ids": torch.arange(8).view(2, 4) + i}


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("depth", [1, 3])
def test_same_batches_same_order_and_the_state_of_each_batch(enabled, depth):
    src = SlowSource(7)
    pf = Prefetcher(src, depth=depth, enabled=enabled, state_fn=lambda: src.reads)
    got = []
    for batch in pf:
        time.sleep(0.002)  # let the producer run ahead
        assert pf.state == int(batch["input_ids"][0, 0]) + 1  # the state after *this* batch, not the prefetched ones
        got.append(batch)
    expected = list(SlowSource(7))
    assert len(got) == 7 and pf.batches == 7
    for a, b in zip(got, expected):
        assert all(torch.equal(a[k], b[k]) for k in b)
    with pytest.raises(StopIteration):
        next(pf)
    pf.close()


def test_prefetch_hides_load_time_and_wait_is_accounted():
    delay, compute, n = 0.03, 0.03, 8
    waits = {}
    for enabled in (False, True):
        pf = Prefetcher(SlowSource(n, delay), depth=4, enabled=enabled)
        for _ in pf:
            time.sleep(compute)  # the "model" (sleep releases the GIL like torch kernels do)
        pf.close()
        waits[enabled] = pf.wait_seconds
    assert waits[False] >= n * delay * 0.9  # every load is waited for in full
    assert waits[True] < waits[False] / 2  # only the first load (and jitter) is not hidden


def test_errors_in_the_source_reach_the_consumer_and_bad_depth_is_refused():
    def broken():
        yield {"x": torch.zeros(1)}
        raise OSError("shard vanished")

    pf = iter(Prefetcher(broken(), depth=2))
    next(pf)
    with pytest.raises(OSError, match="shard vanished"):
        next(pf)
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        Prefetcher([], depth=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enabled", [True, False])
def test_cuda_each_batch_carries_its_own_copy_event(enabled):
    """Step n waits on batch n's copy event only, never on batch n+1's copy queued after it."""
    pf = Prefetcher(SlowSource(6), depth=2, device="cuda", enabled=enabled)
    events, firsts = [], []
    for batch in pf:
        assert batch["input_ids"].is_cuda and isinstance(pf.event, torch.cuda.Event)
        if pf._inflight is not None:  # batch n+1 is being copied: with an event of its own
            assert pf._inflight[2] is not pf.event
        events.append(pf.event)
        firsts.append(int(batch["input_ids"][0, 0]))  # the values arrived (the compute stream waited for the copy)
    pf.close()
    assert firsts == list(range(6)) and len({id(e) for e in events}) == 6
    torch.cuda.synchronize()
    assert all(e.query() for e in events)


def test_cpu_batches_carry_no_event():
    pf = Prefetcher(SlowSource(2), depth=1)
    assert [int(b["input_ids"][0, 0]) for b in pf] == [0, 1] and pf.event is None
    pf.close()

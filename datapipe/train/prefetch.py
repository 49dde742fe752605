"""Prefetch: keep batches ready while the model computes, and measure how long the loop waits for data.

    pf = Prefetcher(loader, depth=4, device=device, state_fn=loader.position)
    for batch in pf: ...            # tensors on `device`; pf.wait_seconds: time spent blocked on data
    pf.state                        # the state captured right after the batch last handed out

A background thread pulls batches from the source and puts up to `depth` of them in a queue, in
pinned host memory when CUDA is used (so host->device copies can be asynchronous). On CUDA the
consumer also keeps one batch in flight on the device: when batch n is handed out, batch n+1's copy
is already queued on a side stream. Each copy records its own CUDA event, and the compute stream
waits on batch n's event only (waiting on the side stream would also wait for batch n+1's copy,
queued after it); `record_stream` tells the caching allocator that the compute stream uses the
tensors, so their memory is not reused while a kernel still reads them. On CPU the same component
runs without streams (the copy is a no-op). With `enabled=False` every batch is read in the calling
thread: the baseline the benchmark compares against.

The source iterator runs ahead of the trainer, so the source's own `state_dict()` describes a later
batch than the one being trained on. `state_fn` (called on the producer thread right after each
batch is read) captures the state that belongs to each batch; `state` returns the state of the
batch last handed out. Only the producer thread iterates the source; a source touched from another
thread as well (a loader receiving loss reports) must be thread-safe itself.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_END = object()


def _pin(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.pin_memory() for k, v in batch.items()}


class Prefetcher:
    def __init__(self, source: Iterable[dict[str, torch.Tensor]], *, depth: int = 2, device: torch.device | str = "cpu",
                 enabled: bool = True, state_fn: Callable[[], Any] | None = None, delay_s: float = 0.0) -> None:
        """
        source: yields dicts of CPU tensors (a PackedLoader).
        depth: batches kept ready on the host (>= 1).
        device: where batches are handed out.
        enabled: False reads each batch in the calling thread when it is asked for (no overlap).
        state_fn: called after each batch is read; its value is `state` once that batch is handed out.
        delay_s: sleep this long before reading each batch: a slow data source, for the benchmark.
        """
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        self.source, self.depth, self.enabled = source, depth, enabled
        self.device = torch.device(device)
        self.state_fn, self.delay_s = state_fn, delay_s
        self.cuda = self.device.type == "cuda"
        self.wait_seconds = 0.0  # time the consumer spent blocked waiting for a batch
        self.batches = 0
        self.state: Any = None
        self._it: Iterator | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._inflight: tuple[dict[str, torch.Tensor], Any, torch.cuda.Event | None] | None = None
        self.event: torch.cuda.Event | None = None  # CUDA: the copy event of the batch last handed out
        self._done = False

    # -- producer --------------------------------------------------------------------------------
    def _read(self) -> tuple[dict[str, torch.Tensor], Any] | object:
        if self.delay_s:
            time.sleep(self.delay_s)
        batch = next(self._it, _END)
        if batch is _END:
            return _END
        state = self.state_fn() if self.state_fn else None
        return (_pin(batch) if self.cuda else batch), state

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._read()
                while not self._stop.is_set():  # a bounded put that notices close()
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if item is _END:
                    return
        except BaseException as exc:  # hand the error to the consumer, which re-raises it
            self._queue.put(exc)

    # -- consumer --------------------------------------------------------------------------------
    def __iter__(self) -> "Prefetcher":
        self._it = iter(self.source)
        self._done, self._inflight = False, None
        if self.enabled:
            self._queue = queue.Queue(maxsize=self.depth)
            self._stop.clear()
            self._thread = threading.Thread(target=self._produce, name="prefetch", daemon=True)
            self._thread.start()
        return self

    def _next_host(self) -> tuple[dict[str, torch.Tensor], Any] | object:
        if not self.enabled:
            return self._read()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _to_device(self, item: tuple[dict[str, torch.Tensor], Any]) -> tuple[dict[str, torch.Tensor], Any, Any]:
        """(batch on the device, state, the CUDA event recorded after this batch's copy; None on CPU)."""
        batch, state = item
        if not self.cuda:
            return batch, state, None
        with torch.cuda.stream(self._stream):  # the copy overlaps whatever the compute stream runs
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return batch, state, copied

    def _use(self, batch: dict[str, torch.Tensor], copied: Any) -> None:
        """Make the compute stream wait for this batch's copy (its own event, not later copies) and own its memory."""
        self.event = copied
        if copied is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(copied)
        for v in batch.values():
            v.record_stream(compute)  # its memory belongs to the compute stream from here on

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        if self.cuda and self.enabled:
            if self._inflight is None:  # first batch: nothing in flight yet
                first = self._next_host()
                if first is _END:
                    raise StopIteration
                self._inflight = self._to_device(first)
            batch, state, copied = self._inflight
            nxt = self._next_host()
            self._inflight = None if nxt is _END else self._to_device(nxt)  # batch n+1 copies during step n
            self._done = nxt is _END
        else:
            item = self._next_host()
            if item is _END:
                self._done = True
                raise StopIteration
            batch, state, copied = self._to_device(item)
        self._use(batch, copied)
        self.wait_seconds += time.perf_counter() - t0
        self.batches += 1
        self.state = state
        return batch

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

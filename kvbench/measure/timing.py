"""Wall-clock timing of code regions.

On CUDA each region is bracketed by CUDA events and nothing synchronises until the times are read,
so timing does not stall the stream; on CPU, where torch runs synchronously, ``time.perf_counter``.
On CUDA the host's time to enqueue each region is kept too: a region whose host time is near its
event time is launch-bound. Unit: milliseconds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, List

import torch

METHOD_CUDA = "cuda_events"
METHOD_CPU = "perf_counter"


def timing_method(device: torch.device | str) -> str:
    """How :class:`RegionTimer` times on ``device``."""
    return METHOD_CUDA if torch.device(device).type == "cuda" else METHOD_CPU


class RegionTimer:
    """Collects the durations of named regions, in order: ``with timer.region("decode"): ...``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._marks: Dict[str, list] = defaultdict(list)
        self._host: Dict[str, List[float]] = defaultdict(list)  # seconds

    @contextmanager
    def region(self, name: str):
        t0 = time.perf_counter()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._marks[name].append((start, end))
        else:
            yield
        self._host[name].append(time.perf_counter() - t0)

    def ms(self, name: str) -> List[float]:
        """Durations of every ``name`` region in milliseconds (synchronises the device once)."""
        marks = self._marks.get(name, [])
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in marks]
        return self.host_ms(name)

    def host_ms(self, name: str) -> List[float]:
        """Host durations of every ``name`` region in milliseconds: on CUDA the time to enqueue it,
        unless something in it synchronised."""
        return [s * 1e3 for s in self._host.get(name, [])]


def sync(device: torch.device | str) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

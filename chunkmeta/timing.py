"""Timing helpers shared by the main job and the benchmarks.

Host time is wall time of one call (``perf_counter_ns``). Device time is measured with CUDA
events around many back-to-back calls queued behind a sleep kernel, so the host stays ahead of
the GPU and the events time the GPU work and its launch gaps, not the host's issue rate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def host_us(fn: Callable[[], object]) -> float:
    """Wall time of one call, in microseconds."""
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def busy_queue(us: float = 1000.0) -> None:
    """Queue ``us`` microseconds of GPU work (a sleep kernel) on the current stream.

    Anything queued after it waits on the GPU, so a call that synchronizes shows that wait as host
    time, and calls that do not return at their own pace.
    """
    # torch.cuda._sleep spins in clock cycles; ~1.98 GHz on an H200 under load. The exact length
    # does not matter, only that it outlasts the host work queued behind it.
    torch.cuda._sleep(int(us * 2000))


def device_us_per_call(
    fn: Callable[[], object], calls: int = 200, lead_us: float | None = None, repeats: int = 1
) -> float:
    """GPU time per call of ``fn``: CUDA events around ``calls`` calls queued behind a sleep kernel;
    with ``repeats`` > 1, the median of that many such measurements.

    Only meaningful for work that does not synchronize (a syncing call drains the queue, and then
    the figure includes its host time). ``lead_us`` (default 50 us a call) must outlast the host
    time of queuing every call, or the GPU catches up and idles between them.
    """
    if repeats > 1:
        return median([device_us_per_call(fn, calls, lead_us) for _ in range(repeats)])
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    busy_queue(calls * 50.0 if lead_us is None else lead_us)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def interleaved_ms(
    run: Callable[[str], object], methods: Sequence[str], rounds: int, wait: Callable[[], object] = lambda: None
) -> dict[str, list[float]]:
    """Wall ms of ``run(method)`` then ``wait()``, for each method once a round, ``rounds`` rounds.

    The order rotates each round (A B C, B C A, ...): drift (clocks, caches, the allocator) and
    whatever one method leaves behind for the next then weigh on every method alike. ``wait`` is
    the end-of-step wait an engine does (``stream.synchronize()``: it copies sampled tokens back
    once a step), inside the time: the step is not done until its GPU work is.
    """
    methods = list(methods)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(rounds):
        k = r % len(methods) if methods else 0
        for method in methods[k:] + methods[:k]:
            start = time.perf_counter()
            run(method)
            wait()
            times[method].append((time.perf_counter() - start) * 1e3)
    return times

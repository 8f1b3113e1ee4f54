"""Regenerate chunkmeta/traces/default.jsonl, the main job's embedded trace.

    python bench/make_trace.py

The trace is ``chunkmeta.workloads.simulate_engine()`` (seeded): 50 steps of a decode-first
engine with chunked prefill, mixed decode+prefill steps, one-token prompts, zero-length padding
rows, steps with no prefill and one long prompt split over several steps.
"""

from pathlib import Path

from chunkmeta.replay import DEFAULT_TRACE, write_trace
from chunkmeta.workloads import simulate_engine

if __name__ == "__main__":
    steps = simulate_engine(seed=0, num_steps=50)
    write_trace(DEFAULT_TRACE, steps)
    print(f"wrote {len(steps)} steps to {Path(DEFAULT_TRACE)}")

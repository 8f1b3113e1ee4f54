"""Diagnostic: the empty-launch floor's drift. gpu_compare's floor method (an empty Triton launch)
measured ~0.2 µs more from its fourth workload on, in every run before it captured three CUDA
graphs first. This times the same empty launch (device µs per call, as gpu_compare does) at the
start, after each workload's setup and warm-up in gpu_compare's order, and after plain
allocations, to see what moves it.

    python bench/diagnostics/launch_floor.py [--out DIR]     (its record: DIR/launch_floor.runs.jsonl)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/: the benchmarks' modules
import results as runs  # bench/results.py: the record format
from anchors import empty_kernel
from gpu_compare import WORKLOADS, Case

from chunkmeta.timing import device_us_per_call


def empty_us() -> float:
    """The empty launch timed as gpu_compare times its floor: 100 calls behind a 5 ms lead,
    median of 5."""
    x = torch.empty(1, device="cuda")
    empty_kernel[(1,)](x)
    return device_us_per_call(lambda: empty_kernel[(1,)](x), calls=100, lead_us=5000.0, repeats=5)


def mib(n_bytes: int) -> int:
    return round(n_bytes / 2**20)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    empty_us()
    print(f"# {torch.cuda.get_device_name()}: empty launch, device µs per call (median of 5 x 100)")
    figures = {"start": empty_us(), "workloads": {}, "after_allocating_mib": {}}
    print(f"start: {figures['start']:.2f}")
    cases = []
    for num_seqs, num_tokens in WORKLOADS:
        case = Case(num_seqs, num_tokens, 64)
        cases.append(case)
        after_setup = empty_us()
        for fn in case.methods.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        w = figures["workloads"][case.key] = {
            "after_setup": after_setup,
            "after_methods": empty_us(),
            "allocated_mib": mib(torch.cuda.memory_allocated()),
            "reserved_mib": mib(torch.cuda.memory_reserved()),
        }
        print(
            f"{case.key}: after its setup {after_setup:.2f}, after its methods ran {w['after_methods']:.2f}, "
            f"allocated {w['allocated_mib']} MiB, reserved {w['reserved_mib']} MiB"
        )
    del cases
    torch.cuda.empty_cache()
    figures["cases_freed"] = empty_us()
    figures["reserved_after_free_mib"] = mib(torch.cuda.memory_reserved())
    print(f"cases freed: {figures['cases_freed']:.2f}, reserved {figures['reserved_after_free_mib']} MiB")
    held = []
    for size in (64, 1024, 16384):
        held.append(torch.empty(size << 20, dtype=torch.uint8, device="cuda"))
        figures["after_allocating_mib"][str(size)] = us = empty_us()
        print(f"after allocating {size} MiB more: {us:.2f}")
    runs.save("launch_floor", figures, script="bench/diagnostics/launch_floor.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

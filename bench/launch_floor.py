"""Diagnostic: the empty-launch floor's drift. gpu_compare's floor method (an empty Triton launch)
measures ~0.2 µs more from its fourth workload on, in every run. This times the same empty
launch (device µs per call, as gpu_compare does) at the start, after each workload's setup and
warm-up in gpu_compare's order, and after plain allocations, to see what moves it.

    python bench/launch_floor.py
"""

from __future__ import annotations

import sys

import torch
from gpu_compare import WORKLOADS, Case
from kernel_sweep import empty_launch_us


def empty_us() -> float:
    """The empty launch timed as gpu_compare times its floor: 100 calls behind a 5 ms lead."""
    return empty_launch_us(calls=100, lead_us=5000.0)


def main() -> int:
    empty_us()
    print(f"# {torch.cuda.get_device_name()}: empty launch, device µs per call (median of 5 x 100)")
    print(f"start: {empty_us():.2f}")
    cases = []
    for num_seqs, num_tokens in WORKLOADS:
        case = Case(num_seqs, num_tokens, 64)
        cases.append(case)
        after_setup = empty_us()
        for fn in case.methods.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        print(f"{case.key}: after its setup {after_setup:.2f}, after its methods ran {empty_us():.2f}, "
              f"allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, "
              f"reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    del cases
    torch.cuda.empty_cache()
    print(f"cases freed: {empty_us():.2f}, reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    held = []
    for mib in (64, 1024, 16384):
        held.append(torch.empty(mib << 20, dtype=torch.uint8, device="cuda"))
        print(f"after allocating {mib} MiB more: {empty_us():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

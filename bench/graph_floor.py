"""Diagnostic: what the number of captured CUDA graphs does to a plain kernel launch.

bench/launch_floor.py found that the empty-launch floor rises by ~0.2 µs during the setup of
gpu_compare's fourth workload and stays there; each workload captures one CUDA graph. This
times the same empty launch (device µs per call, median of 5 x 100) in a fresh process after
capturing 0, 1, ..., 8 trivial graphs, and after freeing them.

    python bench/graph_floor.py
"""

import gc
import sys

import torch
from gpu_compare import capture_trivial_graph
from launch_floor import empty_us as e


def main() -> int:
    e()
    print("graphs 0:", f"{e():.2f}")
    graphs = []
    for i in range(1, 9):
        graphs.append(capture_trivial_graph())
        print(f"graphs {i}:", f"{e():.2f}", flush=True)
    del graphs
    gc.collect()
    torch.cuda.synchronize()
    print("graphs freed:", f"{e():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

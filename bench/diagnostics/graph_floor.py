"""Diagnostic: what the number of captured CUDA graphs does to a plain kernel launch.

launch_floor.py found that the empty-launch floor rises by ~0.2 µs during the setup of
gpu_compare's fourth workload and stays there; each workload captures one CUDA graph. This
times the same empty launch (device µs per call, median of 5 x 100) in a fresh process after
capturing 0, 1, ..., 8 trivial graphs, and after freeing them.

    python bench/diagnostics/graph_floor.py [--out DIR]     (its record: DIR/graph_floor.runs.jsonl)
"""

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/: the benchmarks' modules
import results as runs  # bench/results.py: the record format
from gpu_compare import capture_trivial_graph
from launch_floor import empty_us as e  # this directory's, the script's own


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    e()
    figures = {"graphs": {"0": e()}}
    print("graphs 0:", f"{figures['graphs']['0']:.2f}")
    graphs = []
    for i in range(1, 9):
        graphs.append(capture_trivial_graph())
        figures["graphs"][str(i)] = us = e()
        print(f"graphs {i}:", f"{us:.2f}", flush=True)
    del graphs
    gc.collect()
    torch.cuda.synchronize()
    figures["graphs_freed"] = e()
    print("graphs freed:", f"{figures['graphs_freed']:.2f}")
    runs.save("graph_floor", figures, script="bench/diagnostics/graph_floor.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

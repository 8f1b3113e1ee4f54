"""The GPU work of one ChunkMetadataBuilder.build and one build_chunk_metadata, per workload:
every kernel, memcpy and memset they queue, with its device time from torch.profiler.

    PYTHONPATH=$PWD python3 bench/diagnostics/kernel_profile.py OUT.json

Separates a kernel's own time from what gpu_compare's device figure adds around it (the launch
floor). Run in two trees to compare cores (issue 33: bench/results/kernel_profile-2026-12-03.json).
"""

import argparse
import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from chunkmeta import ChunkMetadataBuilder, build_chunk_metadata
from chunkmeta.workloads import workload


def capacity_for(num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """bench/gpu_compare.py's (not imported: it needs FLA, which a bare tree may lack)."""
    return max(256, num_seqs), max(8192, num_tokens)


WORKLOADS = [(1, 4096), (128, 4096), (1024, 65536), (1, 196608), (4096, 1048576)]  # (sequences, tokens)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSON file to write: per workload and call, each kernel's count and µs")
    args = parser.parse_args(argv)
    out = {}
    for n, t in WORKLOADS:
        b = workload(n, t, seed=n)
        cpu = torch.tensor(b.query_start_loc, dtype=torch.int32)
        gpu = cpu.cuda()
        cs, ct = capacity_for(n, t)
        builder = ChunkMetadataBuilder(cs, ct, chunk_size=64, device="cuda")
        for name, fn in (
            ("build", lambda: builder.build(gpu, cpu)),
            ("oneshot", lambda: build_chunk_metadata(gpu, cpu, chunk_size=64)),
        ):
            for _ in range(30):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(200):
                    fn()
                torch.cuda.synchronize()
            acc = collections.defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    acc[e.name[:60]].append(e.device_time)
            row = {k: (len(v), sorted(v)[len(v) // 2], sum(v) / len(v)) for k, v in acc.items()}
            out[f"{n}x{t // 1024}k {name}"] = row
            print(
                f"{n}x{t // 1024}k {name}:",
                "; ".join(f"{k} x{c} med {m:.3f} mean {a:.3f} us" for k, (c, m, a) in row.items()),
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

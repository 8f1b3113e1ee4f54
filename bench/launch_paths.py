"""Diagnostic: device µs per build of the same kernel through each launch path, to find where
gpu_compare's figure (builder.build) and kernel_sweep's (TritonFill.launch on fixed buffers)
differ.

    python bench/launch_paths.py [--out DIR]     (its record: DIR/launch_paths.runs.jsonl)
"""

from __future__ import annotations

import argparse
import sys

import results as runs  # bench/results.py: the record format
import torch
from gpu_compare import triton_launcher

from chunkmeta import ChunkMetadataBuilder
from chunkmeta.timing import device_us_per_call
from chunkmeta.workloads import workload

CASES = [(1, 196608, 256), (128, 32768, 256), (1024, 65536, 1024), (4096, 1 << 20, 4096)]


def us(fn, calls):
    fn()
    return device_us_per_call(fn, calls=calls, repeats=5)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    figures = {"workloads": {}}
    print(f"# {torch.cuda.get_device_name()}: device µs per build, median of 5 x N calls behind a sleep kernel")
    for num_seqs, num_tokens, cap_seqs in CASES:
        batch = workload(num_seqs, num_tokens, seed=num_seqs)
        qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
        qsl = qsl_cpu.cuda()
        row = []
        for ring in (4, 1):
            b = ChunkMetadataBuilder(cap_seqs, max(8192, num_tokens), device="cuda", ring_depth=ring)
            md = b.build(qsl, qsl_cpu)
            b.build(qsl, qsl_cpu)
            for calls in (100, 200):
                row.append((f"build ring={ring} calls={calls}", us(lambda: b.build(qsl, qsl_cpu), calls)))
            if ring == 1:
                launch = triton_launcher(b, qsl, num_seqs, md.num_chunks)
                assert launch is not None, "no direct launcher (CHUNKMETA_FAST_LAUNCH=0 or a launch hook)"
                row.append(("TritonFill.launch slot 0 calls=200", us(launch, 200)))
        key = f"{num_seqs}x{num_tokens // 1024}k"
        figures["workloads"][key] = {"capacity": cap_seqs, "paths": dict(row)}
        print(f"{key} cap={cap_seqs}: " + "  ".join(f"{k}: {v:.2f}" for k, v in row))
    runs.save("launch_paths", figures, script="bench/launch_paths.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

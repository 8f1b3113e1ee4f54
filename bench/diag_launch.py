"""Where a step-table build's and a one-shot's host time goes, on a CUDA machine (a diagnostic).

    python bench/diag_launch.py

Times, per call (medians of 2,000): the whole build, its kernel launch alone (the fast launcher,
when it is in use), and one device allocation.
"""

import statistics
import time

import numpy as np
import torch

from chunkmeta import StepTablesBuilder, build_chunk_metadata
from chunkmeta import builder as builder_module
from chunkmeta import tables as T


def per_call_us(fn, calls=2000):
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples)


def main():
    lengths = [1] * 32 + [500] * 32
    qsl_cpu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    qsl = qsl_cpu.cuda()
    prefill_cpu = (qsl_cpu[32:] - qsl_cpu[32]).contiguous()
    prefill = prefill_cpu.cuda()
    specs = {"fla": T.Fla(64), "fla_batch": T.Fla(64, rows="batch"), "conv": T.Conv()}
    builder = StepTablesBuilder(1024, 66560, tables=specs, device="cuda")
    builder.build(qsl, qsl_cpu, first_seq=32)
    build_chunk_metadata(prefill, prefill_cpu)
    torch.cuda.synchronize()
    fill = builder._fills[False]
    print("step fill fast launchers:", list(fill._launchers))
    oneshot = next(iter(builder_module._ONE_SHOT_FILLS.values()))
    print("one-shot fast launchers:", list(oneshot._launchers))
    ints = (32, 32, 64, 300, 300, 2000, 0, 0, 0)
    dtypes = (torch.int32, torch.int32, torch.int32)
    pointers = (
        qsl.data_ptr(),
        builder._dummy.data_ptr(),
        builder._dummy.data_ptr(),
        builder.ring.pointer(0),
        qsl.data_ptr(),
    )
    figures = {
        "step build": per_call_us(lambda: builder.build(qsl, qsl_cpu, first_seq=32)),
        "step launch alone": per_call_us(lambda: fill.launch(dtypes, pointers, ints)),
        "one-shot build": per_call_us(lambda: build_chunk_metadata(prefill, prefill_cpu)),
        "torch.empty (cuda)": per_call_us(lambda: torch.empty(1000, dtype=torch.int64, device="cuda")),
        "empty Python call": per_call_us(lambda: None),
    }
    for name, us in figures.items():
        print(f"{name}: {us:.1f} us")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

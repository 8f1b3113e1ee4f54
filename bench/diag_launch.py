"""Where a step-table build's and a one-shot's host time goes, on a CUDA machine (a diagnostic).

    python bench/diag_launch.py

Times, per call (medians of 2,000): the whole build, its kernel launch alone (the fast launcher,
when it is in use), and one device allocation.
"""

import statistics
import time

import numpy as np
import torch

from chunkmeta import StepTablesBuilder, build_chunk_metadata, plan
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
    # the C build's parts: its one C call (checks, counts, host copies, the launch), then the
    # result objects (chunkmeta.results)
    key = (False, torch.int32, torch.int32, torch.int32)
    capsule, launches = builder._steps[key]
    print("step C build launches:", launches)
    host = builder._last_inputs[1]
    stream = torch._C._cuda_getCurrentRawStream(0)
    dummy = builder._dummy.data_ptr()
    step_args = (capsule, *host, 32, None, 0, False, 0, False, qsl.data_ptr(), dummy, dummy, 1, stream)
    counts, facts = builder._native.step(*step_args)
    make_results = builder._results[False]
    module = builder._native
    n, nt = 32, 300
    cu_cpu = torch.empty(n + 1, dtype=torch.int32)
    figures = {
        "step build": per_call_us(lambda: builder.build(qsl, qsl_cpu, first_seq=32)),
        "step: native.step (host side + launch)": per_call_us(lambda: builder._native.step(*step_args)),
        "step: result objects": per_call_us(lambda: make_results(1, 7, counts, facts)),
        "step launch alone (Triton fast launcher)": per_call_us(lambda: fill.launch(dtypes, pointers, ints)),
        "one-shot build": per_call_us(lambda: build_chunk_metadata(prefill, prefill_cpu)),
        "one-shot: its tensors (1 allocation, split, views)": per_call_us(
            lambda: builder_module._one_shot_tensors(n, nt, torch.int32, qsl.device, zeroed=False)
        ),
        "one-shot: host cu_seqlens (torch.empty cpu)": per_call_us(lambda: torch.empty(n + 1, dtype=torch.int32)),
        "one-shot: oneshot_plan": per_call_us(
            lambda: module.oneshot_plan(*plan.plain_host_tensor(prefill_cpu), 0, None, 6, cu_cpu.data_ptr(), n + 1)
        ),
        "torch.empty (cuda)": per_call_us(lambda: torch.empty(1000, dtype=torch.int64, device="cuda")),
        "empty Python call": per_call_us(lambda: None),
    }
    for name, us in figures.items():
        print(f"{name}: {us:.1f} us")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

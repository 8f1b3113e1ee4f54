"""Where a step-table build's and a one-shot's host time goes, on a CUDA machine (a diagnostic).

    python bench/diagnostics/diag_launch.py [--out DIR]

Times, per call (medians of 2,000): a KDA/GDN step build (FLA prefill + batch + conv1d, 32 + 32
requests), its one C call (``native.step``: all of it but ``build``'s Python frame), that call's
host side alone (no launch, no results) and its result objects; the Mamba2 step build (SSD
chunks + conv1d of the prefill rows), also with new tensor objects each call as an engine passes
them, and its C call; the Triton launcher alone; the one-shot and its parts; one device
allocation; and at 1024 requests (``large_step_parts``) the same parts of the KDA/GDN and the
hybrid step's build. With
``--out`` it writes its record (``bench/results.py``: ``diag_launch.runs.jsonl``) there.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from chunkmeta import StepTablesBuilder, arena, build_chunk_metadata
from chunkmeta import one_shot as one_shot_module
from chunkmeta import tables as T

sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/: the benchmarks' modules
import results as runs
from step_tables import CAPACITY, MAMBA_CHUNK, make_case

from chunkmeta.replay import kda_tables, mamba2_tables


def per_call_us(fn, calls=2000):
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples)


def host_only_step(builder):
    """A ``native.step`` state of ``builder``'s own entries without a kernel: a call does the
    host side alone (checks, counts, host copies) and returns ``(slot, generation, counts,
    facts)``, claiming but never publishing."""
    ring = builder.ring
    arenas = [ring.pointer(k) for k in range(ring.depth)]
    capsule = builder.native_steps(0, 1, 1, 0, False, arenas, ring.host_pointers())
    return builder._make_c_step([(capsule,) * 8] * 2)


def large_step_parts() -> dict:
    """Where a build's host time goes at 1024 requests / 65,536 tokens (``bench/step_tables.py``'s
    largest workload, its batch), for the KDA/GDN step and the hybrid one: the build, its C call,
    that call's host side alone (the same builder's entries, no kernel: the difference is the
    launch, the results and the publish) and the result objects."""
    qsl_cpu, computed_cpu = make_case(0, 1024, 65536, seed=1024)
    qsl, computed = qsl_cpu.cuda(), computed_cpu.cuda()
    figures = {}
    for label, specs in (("kda/gdn", kda_tables(64)), ("hybrid", {**kda_tables(64), **mamba2_tables(MAMBA_CHUNK)})):
        builder = StepTablesBuilder(*CAPACITY, tables=specs, device="cuda")
        c_in = (computed, computed_cpu) if builder.needs_computed else (None, None)
        rows = dict(zip(("num_computed_tokens", "num_computed_tokens_cpu"), c_in, strict=True))
        builder.build(qsl, qsl_cpu, **rows)
        host_only = host_only_step(builder)
        step_args = (qsl, qsl_cpu, 0, None, *c_in, None, None, False)
        _, _, counts, facts = builder._native.step(host_only, *step_args)
        make_results = builder._results[False]
        figures[f"1024 requests, {label}: step build"] = per_call_us(lambda: builder.build(qsl, qsl_cpu, **rows))
        figures[f"1024 requests, {label}: native.step"] = per_call_us(
            lambda: builder._native.step(builder._c_step, *step_args)
        )
        figures[f"1024 requests, {label}: its host side alone"] = per_call_us(
            lambda: builder._native.step(host_only, *step_args)
        )
        figures[f"1024 requests, {label}: result objects"] = per_call_us(lambda: make_results(1, 7, counts, facts))
    torch.cuda.synchronize()
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the record under this directory")
    args = parser.parse_args(argv)
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
    fill = builder._fills[(False, False)]
    print("step fill fast launchers:", list(fill._launchers))
    oneshot = next(iter(one_shot_module._FILLS.values()))
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
    # the C build's parts: its one C call (the input tensors' checks, the table checks, counts,
    # host copies, the launch, the result objects, the publish), the host side alone, the results
    key = (False, torch.int32, torch.int32, torch.int32)
    _, launches = builder._steps[key]  # the kernel the C build launches
    print("step C build launches:", launches)
    stream = torch._C._cuda_getCurrentRawStream(0)
    step_args = (qsl, qsl_cpu, 32, None, None, None, None, None, False)
    host_only = host_only_step(builder)
    _, _, counts, facts = builder._native.step(host_only, *step_args)
    make_results = builder._results[False]
    # the Mamba2 step's build (SSD chunks + conv1d of the prefill rows): its C call reads two more
    # tensors, the rows' computed-token counts
    computed_cpu = torch.tensor([100] * 64, dtype=torch.int32)
    computed = computed_cpu.cuda()
    mamba2 = StepTablesBuilder(
        1024, 66560, tables={"mamba2": T.Mamba2(chunk_size=256), "conv": T.Conv(rows="prefill")}, device="cuda"
    )
    rows = dict(first_seq=32, num_computed_tokens=computed, num_computed_tokens_cpu=computed_cpu)
    mamba2.build(qsl, qsl_cpu, **rows)
    m_args = (mamba2._c_step, qsl, qsl_cpu, 32, None, computed, computed_cpu, None, None, False)
    # the views an engine passes: new tensor objects each step
    views = [(qsl[:], qsl_cpu[:], computed[:], computed_cpu[:]) for _ in range(64)]
    turn = iter(range(1 << 40))

    def mamba2_engine_pattern():
        q, q_cpu, c, c_cpu = views[next(turn) & 63]
        mamba2.build(q, q_cpu, first_seq=32, num_computed_tokens=c, num_computed_tokens_cpu=c_cpu)

    n, nt = 32, 300
    one_shot_arena = arena.arena(0, stream)
    layout = T.one_shot_layout(64, 32, torch.int32)
    figures = {
        "step build": per_call_us(lambda: builder.build(qsl, qsl_cpu, first_seq=32)),
        "step: native.step (the whole C build)": per_call_us(lambda: builder._native.step(builder._c_step, *step_args)),
        "step: its host side alone": per_call_us(lambda: builder._native.step(host_only, *step_args)),
        "step: result objects": per_call_us(lambda: make_results(1, 7, counts, facts)),
        "mamba2 step build": per_call_us(lambda: mamba2.build(qsl, qsl_cpu, **rows)),
        "mamba2 step build, new tensor objects each call": per_call_us(mamba2_engine_pattern),
        "mamba2 step: native.step": per_call_us(lambda: mamba2._native.step(*m_args)),
        "a tensor view (what an engine makes per input per step)": per_call_us(lambda: qsl[:]),
        "step launch alone (Triton fast launcher)": per_call_us(lambda: fill.launch(dtypes, pointers, ints)),
        "one-shot build": per_call_us(lambda: build_chunk_metadata(prefill, prefill_cpu)),
        "one-shot: its outputs (4 views from chunkmeta.arena)": per_call_us(
            lambda: one_shot_arena.take(n, nt, layout.offsets_at, layout.indices_at, False)
        ),
        "one-shot: its outputs if allocated (a block of their size, views)": per_call_us(
            lambda: arena.Arena(0, block_bytes=0, host_entries=0).take(
                n, nt, layout.offsets_at, layout.indices_at, False
            )
        ),
        "torch.empty (cuda)": per_call_us(lambda: torch.empty(1000, dtype=torch.int64, device="cuda")),
        "empty Python call": per_call_us(lambda: None),
        **large_step_parts(),
    }
    for name, us in figures.items():
        print(f"{name}: {us:.1f} us")
    torch.cuda.synchronize()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        runs.save("diag_launch", {"us": figures}, script="bench/diagnostics/diag_launch.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The CUDA C step fill's logic on the host, on every CI run.

``chunkmeta/csrc/step_fill.cu`` (launched by chunkmeta.native's step build on an NVIDIA GPU) is
compiled here by the host C++ compiler through tests/support/step_host.cpp (CUDA's built-ins as
host code: tests/support/cuda_host.h), with the constants ``CudaStepFill`` gives NVRTC, under
AddressSanitizer and UBSan. Each case's arena must equal, byte for byte, the one a CPU builder
writes for the same step (``StepTablesBuilder(backend="torch")``: the torch fill on a layout's
first build, then the C build's own fill, ``cpu_fill_entry``; both checked against
``chunkmeta.reference`` in tests/core/test_step_tables.py), and its tables are checked against the
reference too. Covered: every entry kind, exact and padded layouts, int32 and int64 inputs,
capacities with one to many sequences per thread. Without a C++20 compiler every test skips.
"""

import functools
import subprocess

import numpy as np
import pytest
import torch
from test_cuda_fill_host import SUPPORT, compile_harness, cxx

from checks import assert_step_tables
from chunkmeta import StepTablesBuilder, jit
from chunkmeta.fill import cuda_fill
from strategies import STEP_SPECS, STEP_SPECS_B, random_step

HARNESS = SUPPORT / "step_host.cpp"


@functools.cache
def host_binary(entries, capacity: int, padded: bool, types: tuple[str, str, str]):
    compiler = cxx()
    fill = cuda_fill.CudaStepFill(entries=entries, block_seqs=capacity, padded=padded)
    names = ("QSL_T", "COMP_T", "CKPT_T")
    defines = [f"-D{name}={value}" for name, value in (*zip(names, types, strict=True), *fill.defines)]
    flags = ["-std=c++20", "-O1", "-g", "-pthread", f"-I{jit.CSRC}", f"-I{SUPPORT}", *defines, str(HARNESS)]
    inputs = [
        jit.CSRC / "step_fill.cu",
        jit.CSRC / "step_chunks.h",
        jit.CSRC / cuda_fill.ROW_SEARCH,
        HARNESS,
        SUPPORT / "cuda_host.h",
        SUPPORT / "step_host_main.h",
    ]
    return fill, compile_harness(compiler, flags, inputs)


def run_cases(binary, cases) -> list[bytes]:
    """Each case's arena: ``(qsl, computed, checkpoints, first, n, batch, rows, arena_bytes)``."""
    lines = [str(len(cases))]
    for qsl, computed, checkpoints, first, n, batch, rows, arena_bytes in cases:
        for values in (qsl, computed, checkpoints):
            lines.append(f"{len(values)} " + " ".join(map(str, values)))
        lines.append(" ".join(map(str, (first, n, batch, *rows, *([0] * (6 - len(rows))), arena_bytes))))
    done = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]
    return [bytes.fromhex(line.split()[1]) if len(line.split()) > 1 else b"" for line in done.stdout.splitlines()]


@pytest.mark.parametrize("specs", [STEP_SPECS, STEP_SPECS_B], ids=["five-kinds", "paired-and-plain"])
@pytest.mark.parametrize("capacity,wide", [(12, False), (300, True)])  # int64 inputs at many sequences per thread
@pytest.mark.parametrize("padded", [False, True])
def test_cuda_step_fill_equals_the_torch_fill(specs, capacity, padded, wide):
    tokens = 2048 if capacity == 12 else 20000
    builder = StepTablesBuilder(capacity, tokens, tables=specs, device="cpu", backend="torch", ring_depth=1)
    dtype = torch.int64 if wide else torch.int32
    types = tuple(cuda_fill.qsl_type(t) for t in (dtype, dtype, torch.int32))
    fill, binary = host_binary(builder.layout.entries, capacity, padded, types)
    rng = np.random.default_rng(capacity + 2 * padded + wide)
    steps = [random_step(rng, capacity, tokens) for _ in range(25)]
    cases, expected = [], []
    for qsl, first, n, computed, checkpoints in steps:
        q, c = torch.tensor(qsl, dtype=dtype), torch.tensor(computed, dtype=dtype)
        k = torch.tensor(checkpoints, dtype=torch.int32)
        with torch.inference_mode():  # the ring's tables are inference tensors (chunkmeta.ring.TABLE_MEMORY)
            builder.ring.arena.zero_()  # the kernel's arena starts zeroed in the harness
        tables = builder.build(
            q,
            q,
            first_seq=first,
            num_seqs=n,
            num_computed_tokens=c,
            num_computed_tokens_cpu=c,
            checkpoint_offsets=k,
            checkpoint_offsets_cpu=k,
            padded=padded,
        )
        assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
        counts = builder.plan_host(q.numpy(), first, n, c, k)[1]
        rows = builder.layout.rows_pad if padded else counts
        arena = builder.ring.arena[0].numpy().tobytes()
        cases.append((qsl, computed, checkpoints, first, n, len(qsl) - 1, rows, len(arena)))
        expected.append(arena)
    got = run_cases(binary, cases)
    for case, want, have in zip(cases, expected, got, strict=True):
        assert have == want, case

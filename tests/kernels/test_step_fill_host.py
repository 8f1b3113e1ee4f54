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
import shutil
import subprocess

import numpy as np
import pytest
import torch

from checks import assert_step_tables
from chunkmeta import StepTablesBuilder, jit, layout, reference, tables
from chunkmeta.fill import cuda_fill
from chunkmeta.fill.torch_fill import fill_entry_torch
from host_harness import SUPPORT, compile_harness, cxx
from strategies import STEP_SPECS, STEP_SPECS_B, random_step

HARNESS = SUPPORT / "step_host.cpp"


@functools.cache
def host_binary(
    entries, capacity: int, padded: bool, types: tuple[str, str, str], csrc=jit.CSRC, row_capacities=(), spans=None
):
    compiler = cxx()
    fill = cuda_fill.CudaStepFill(
        entries=entries, block_seqs=capacity, padded=padded, row_capacities=row_capacities, shared_spans=spans
    )
    names = ("QSL_T", "COMP_T", "CKPT_T")
    defines = [f"-D{name}={value}" for name, value in (*zip(names, types, strict=True), *fill.defines)]
    flags = ["-std=c++20", "-O1", "-g", "-pthread", f"-I{csrc}", f"-I{SUPPORT}", *defines, str(HARNESS)]
    inputs = [
        csrc / "step_fill.cu",
        csrc / "step_chunks.h",
        csrc / cuda_fill.ROW_SEARCH,
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


# Mamba2 / logical rows read their sequence's span from shared memory where it fits (spans None:
# the fill's own choice, on at these capacities), else from global memory (False: what 2048 and
# more sequence lanes get)
SPAN_CASES = [
    *(
        (specs, capacity, wide, None)
        for specs in (STEP_SPECS, STEP_SPECS_B)
        for capacity, wide in ((12, False), (300, True))
    ),
    (STEP_SPECS, 300, True, False),
    # four rounds a thread (1024 lanes of 256 threads): the shape builders of 513-1024 sequences get
    (STEP_SPECS, 1000, True, None),
]


@pytest.mark.parametrize(
    "specs,capacity,wide,spans",
    SPAN_CASES,
    ids=[
        "five-kinds-12",
        "five-kinds-300",
        "paired-and-plain-12",
        "paired-and-plain-300",
        "five-kinds-300-global-spans",
        "five-kinds-1000",
    ],
)  # int64 inputs at many sequences per thread
@pytest.mark.parametrize("padded", [False, True])
def test_cuda_step_fill_equals_the_torch_fill(specs, capacity, padded, wide, spans):
    tokens = {12: 2048, 300: 20000}.get(capacity, 40000)
    builder = StepTablesBuilder(capacity, tokens, tables=specs, device="cpu", backend="torch", ring_depth=1)
    dtype = torch.int64 if wide else torch.int32
    types = tuple(cuda_fill.qsl_type(t) for t in (dtype, dtype, torch.int32))
    # the builder's kernel packs two rounds of the scan per shuffle (every entry's rows fit 16
    # bits; two rounds at capacity 300); the other spec set keeps one round per shuffle
    paired = builder.layout.rows_pad if specs is STEP_SPECS else ()
    fill, binary = host_binary(builder.layout.entries, capacity, padded, types, row_capacities=paired, spans=spans)
    assert ("PAIRED_ENTRIES", 0) not in fill.defines or specs is not STEP_SPECS
    assert ("SHARED_SPANS", int(spans is None)) in fill.defines
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


def fla_cases(entry, capacity: int, tokens: int, count: int, seed: int, bounded=False, dtype=torch.int32):
    """``count`` random steps as harness cases for one FLA entry, with the arena the torch fill
    writes for each (from zero, as the harness's): exact rows, or a bounded build's bound."""
    rng = np.random.default_rng(seed)
    shift, off_cu, off_rows, off_offsets = entry.shift, entry.off0, entry.off1, entry.off2
    rows_at = 16 if entry.flag & tables.FLA_INDICES_64 else 8
    cases, expected = [], []
    for _ in range(count):
        qsl, first, n, _, _ = random_step(rng, capacity, tokens)
        ref = reference.chunk_metadata(qsl, 1 << shift, first, n)
        rows = layout.chunk_row_bound(n, tokens, 1 << shift) if bounded else ref.num_chunks
        size = off_rows + rows_at * max(rows, 1) + 16 * (capacity + 2)
        arena = torch.zeros(size, dtype=torch.uint8)
        seqs = capacity + 2
        regions = (
            arena[off_cu : off_cu + 4 * seqs].view(torch.int32),
            arena[off_rows : off_rows + rows_at * rows].view(torch.int64 if rows_at == 16 else torch.int32),
            arena[off_offsets : off_offsets + 8 * seqs].view(torch.int64 if entry.flag & 1 else torch.int32),
            None,
        )
        q = torch.tensor(qsl, dtype=dtype)
        fill_entry_torch(entry, q, q, q, regions, first, n, rows, bounded)
        cases.append((qsl, [], [], first, n, len(qsl) - 1, (rows,), size))
        expected.append(arena.numpy().tobytes())
    return cases, expected


@pytest.mark.parametrize("pad", [None, *layout.PADS])
@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("capacity", [40, 64])
def test_fla_layouts_equal_the_torch_fill(pad, offsets_dtype, capacity):
    """ChunkMetadataBuilder's layouts (one Fla entry: exact and every padding) and both
    chunk_offsets dtypes; at capacity 64 the tail-padded cu_seqlens has an entry past the
    kernel's sequence lanes."""
    check_fla_layout(pad, offsets_dtype, capacity, tokens=3000, steps=20)


@pytest.mark.parametrize("pad", [None, "tail"])
def test_fla_scan_of_many_rounds_equals_the_torch_fill(pad):
    """2048 sequences: four rounds a lane, scanned two per shuffle as the builder compiles it."""
    check_fla_layout(pad, torch.int64, 2048, tokens=200_000, steps=6, paired=True)


def check_fla_layout(pad, offsets_dtype, capacity, tokens, steps, paired=False):
    spec = {"fla": tables.Fla(64, offsets_dtype=offsets_dtype)}
    builder = StepTablesBuilder(
        capacity, tokens, tables=spec, device="cpu", backend="torch", ring_depth=1, pad=pad or "tail"
    )
    fill, binary = host_binary(
        builder.layout.entries,
        capacity,
        pad is not None,
        ("int", "int", "int"),
        row_capacities=builder.layout.rows_pad if paired else (),
    )
    assert dict(fill.defines)["PAIRED_ENTRIES"] == int(paired)
    rng = np.random.default_rng(7)
    for _ in range(steps):
        qsl, first, n, _, _ = random_step(rng, capacity, tokens)
        q = torch.tensor(qsl, dtype=torch.int32)
        with torch.inference_mode():
            builder.ring.arena.zero_()
        builder.build(q, q, first_seq=first, num_seqs=n, padded=pad is not None)
        rows = builder.layout.rows_pad if pad else builder.plan_host(q.numpy(), first, n, None, None)[1]
        arena = builder.ring.arena[0].numpy().tobytes()
        (got,) = run_cases(binary, [(qsl, [], [], first, n, len(qsl) - 1, rows, len(arena))])
        assert got == arena, (qsl, first, n)


@pytest.mark.parametrize("indices_dtype", [torch.int32, torch.int64])
def test_the_one_shot_entry_equals_the_torch_fill(indices_dtype):
    """The one-shot's entry: entry 0 written, int64 chunk_offsets, int32 or int64 chunk_indices."""
    entry = tables.one_shot_layout(64, 32, indices_dtype).entry
    _, binary = host_binary((entry,), 32, False, ("int", "int", "int"))
    cases, expected = fla_cases(entry, 32, 2000, 20, seed=3)
    assert run_cases(binary, cases) == expected


def test_a_bounded_entry_equals_the_torch_fill():
    """A bounded build's entry (SEQS_EXACT): padded rows up to the bound, the slice's own sequences."""
    entries = tables.slot_layout({"fla": tables.Fla(64)}, 40, 3000, "past_end").entries
    (entry,) = tables.bounded_entries(entries)
    _, binary = host_binary((entry,), 40, True, ("int", "int", "int"))
    cases, expected = fla_cases(entry, 40, 3000, 20, seed=5, bounded=True)
    assert run_cases(binary, cases) == expected


def test_the_harness_catches_a_wrong_kernel(tmp_path):
    """The check is not vacuous: step_fill.cu with its row search off by one (``<`` for ``<=``
    in row_search.h), found first on the include path, fails."""
    real = (jit.CSRC / cuda_fill.ROW_SEARCH).read_text()
    broken = real.replace("const bool in_a = a <= r", "const bool in_a = a < r")
    assert broken != real
    (tmp_path / cuda_fill.ROW_SEARCH).write_text(broken)
    for name in ("step_fill.cu", "step_chunks.h"):
        shutil.copy(jit.CSRC / name, tmp_path / name)
    entry = tables.one_shot_layout(64, 32, torch.int32).entry
    _, binary = host_binary((entry,), 32, False, ("int", "int", "int"), csrc=tmp_path)
    cases, expected = fla_cases(entry, 32, 2000, 8, seed=3)
    assert run_cases(binary, cases) != expected


def test_shared_spans_only_where_the_static_shared_memory_allows():
    """ptxas caps a kernel's static shared memory at 48 KiB: the five-kinds tables' Mamba2 and
    logical spans fit beside ends[] up to 1024 sequence lanes, not at 4096."""
    for capacity, on in ((1024, 1), (4096, 0)):
        entries = StepTablesBuilder(capacity, 65536, tables=STEP_SPECS, device="cpu", backend="torch").layout.entries
        assert any(e.kind in (tables.MAMBA2, tables.LOGICAL) for e in entries)
        fill = cuda_fill.CudaStepFill(entries=entries, block_seqs=capacity, padded=True)
        assert ("SHARED_SPANS", on) in fill.defines

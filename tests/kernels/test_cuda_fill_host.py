"""The CUDA C fill's logic on the host, on every CI run.

The CUDA C fill (``chunkmeta/csrc/chunk_fill.cu``, launched by ``chunkmeta.fill.cuda_fill``) only
runs on an NVIDIA GPU, and the GPU tests (tests/core/test_gpu.py) need one. Here the same file and
its header, ``chunk_fill.h``, are compiled by the host C++ compiler through
tests/support/cuda_host.cpp, which includes them after tests/support/cuda_host.h (each CUDA thread
a std::thread, with CUDA's barrier and shuffle semantics), with the kernel's constants as ``-D``
(``CudaFill.defines``), under AddressSanitizer and UBSan. The grid and the arguments are
chunkmeta.native's, the outputs exactly sized and poisoned, and every table is compared with
``chunkmeta.reference``.

Covered: exact and every padded layout (tail, negative, past_end: ``PAD_CHUNK``); int32 and int64
offsets (int64 ones past 2^31 too); capacities with one to many sequences per thread and a
non-power-of-two capacity; the sweep's odd launch shapes; decode-first slices, zero-length and
one-token sequences, chunk-size boundaries, one long prompt, empty slices in the padded layouts.
It checks the algorithm, memory safety and integer behaviour, not the GPU's timing or its memory
model. Without a C++20 compiler (``CXX``, else g++ or clang++) every test here skips, saying so.
"""

import atexit
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkmeta import jit, layout, reference
from chunkmeta.fill import cuda_fill
from chunkmeta.workloads import from_lengths, random_decode_first

SUPPORT = Path(__file__).parents[1] / "support"  # cuda_host.cpp, cuda_host.h, cuda_host_main.h
HARNESS = SUPPORT / "cuda_host.cpp"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


def cxx() -> list[str]:
    """The C++ compiler command (``CXX`` split as a shell would, else g++ or clang++), or a skip."""
    words = shlex.split(os.environ.get("CXX", ""))
    if words:
        found = shutil.which(words[0])
        if found is None:
            pytest.skip(f"no C++ compiler: CXX={os.environ['CXX']!r} is not an executable on PATH")
        return [found, *words[1:]]
    found = shutil.which("g++") or shutil.which("clang++")
    if found is None:
        pytest.skip("no C++ compiler: CXX is unset and neither g++ nor clang++ is on PATH")
    return [found]


@functools.cache
def build_dir() -> Path:
    # removed at exit: each run's harnesses take ~20 MB, and CI's disk has run out before
    path = tempfile.mkdtemp(prefix="chunkmeta-cuda-host-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return Path(path)


@functools.cache
def host_binary(chunk_size: int, capacity: int, padded: bool, qsl_t: str, csrc: Path = jit.CSRC, **shape):
    """(the fill's launch shape, the host program compiled from ``csrc``'s chunk_fill.cu), or a
    skip without a C++20 compiler."""
    compiler = cxx()
    fill = cuda_fill.CudaFill(chunk_size=chunk_size, block_seqs=capacity, padded=padded, **shape)
    defines = [f"-D{name}={value}" for name, value in (("QSL_T", qsl_t), *fill.defines)]
    flags = ["-std=c++20", "-O1", "-g", "-pthread", f"-I{csrc}", f"-I{SUPPORT}", *defines, str(HARNESS)]
    inputs = [
        csrc / "chunk_fill.cu",
        csrc / cuda_fill.HEADER,
        csrc / cuda_fill.ROW_SEARCH,
        HARNESS,
        SUPPORT / "cuda_host.h",
        SUPPORT / "cuda_host_main.h",
    ]
    return fill, compile_harness(compiler, flags, inputs)


def compile_harness(compiler: list[str], flags: list[str], inputs: list[Path]) -> Path:
    """A host harness program, built once per compiler, flags and input texts (under the
    sanitizers where the toolchain has their runtimes), or a skip without C++20's <barrier>."""
    key = hashlib.sha1(repr((compiler, flags, [path.read_bytes() for path in inputs])).encode()).hexdigest()[:16]
    binary = build_dir() / key
    done = subprocess.run([*compiler, *SANITIZE, *flags, "-o", str(binary)], capture_output=True, text=True)
    if done.returncode:  # a toolchain without the sanitizers' runtimes: plain, still checked
        done = subprocess.run([*compiler, *flags, "-o", str(binary)], capture_output=True, text=True)
    if done.returncode:
        if "barrier" in done.stderr and "No such file" in done.stderr:
            pytest.skip(f"{compiler[0]} has no C++20 <barrier>")
        raise AssertionError(done.stderr[-3000:])
    return binary


def run_fill(binary: Path, cases) -> list[tuple[list, list, list]]:
    """The kernel's (cu_seqlens, chunk_offsets, rows) per case ``(q, first_seq, num_seqs, num_rows,
    seqs_out, pad_seq)``."""
    lines = [str(len(cases))]
    for q, *scalars in cases:
        lines += [f"{len(q)} " + " ".join(map(str, q)), " ".join(map(str, scalars))]
    done = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]
    out = done.stdout.splitlines()
    results = []
    for k in range(0, len(out), 3):
        cu, offsets, rows = (list(map(int, line.split()[1:])) for line in out[k : k + 3])
        results.append((cu, offsets, [[i, t] for i, t in zip(rows[::2], rows[1::2], strict=True)]))
    return results


def batches(rng, capacity: int, chunk_size: int, count: int, base: int = 0):
    """Prefill slices of at most ``capacity`` sequences, of many kinds, as reference batches."""
    made = []
    for k in range(count):
        kind = k % 4
        if kind == 0:
            b = random_decode_first(rng, capacity, chunk_size * max(2 * capacity, 512), chunk_size)
        else:
            n = int(rng.choice([0, 1, capacity, int(rng.integers(0, capacity + 1))]))
            first = int(rng.integers(0, 4))
            if kind == 1:  # edges: empty, one token, around the chunk size
                choices = [0, 0, 1, chunk_size - 1, chunk_size, chunk_size + 1, 2 * chunk_size + 1]
            elif kind == 2:  # mostly empty
                choices = [0, 0, 0, 0, 1]
            else:  # short ones
                choices = [1, 1, 3]
            lengths = [int(rng.integers(0, 20)) for _ in range(first)] + list(rng.choice(choices, size=n))
            if kind == 3 and n:  # and one long prompt: rows spanning several programs
                lengths[first + int(rng.integers(0, n))] = 700 * chunk_size + 1
            b = from_lengths(lengths + [int(rng.integers(0, 9))] * int(rng.integers(0, 2)), first_seq=first)
            b = type(b)(b.query_start_loc, first, n)  # the trailing request is after the slice
        made.append(type(b)([v + base for v in b.query_start_loc], b.first_seq, b.num_seqs))
    return made


def check(capacity: int, pad, qsl_t: str, count: int, chunk_size: int = 64, base: int = 0, **shape):
    """Every table of ``count`` batches equals the reference (the exact layout's empty slices
    launch nothing, as in chunkmeta.native, so they are not run)."""
    pad_seq, pad_chunk = (0, 0) if pad is None else layout.padding_row(pad, capacity)
    fill, binary = host_binary(chunk_size, capacity, pad is not None, qsl_t, pad_chunk=pad_chunk, **shape)
    rng = np.random.default_rng(
        capacity * 31 + len(qsl_t) + (pad == "tail") + 2 * (pad == "negative") + 3 * (pad == "past_end")
    )
    cases, expected = [], []
    for b in batches(rng, capacity, chunk_size, count, base):
        ref = reference.chunk_metadata(b.query_start_loc, chunk_size, b.first_seq, b.num_seqs)
        if pad is None:
            if b.num_seqs == 0:
                continue
            cases.append((b.query_start_loc, b.first_seq, b.num_seqs, ref.num_chunks, b.num_seqs, 0))
        else:
            seqs_out = layout.padded_num_seqs(pad, capacity)
            rows = ref.num_chunks + int(rng.integers(0, 2 * fill.block_rows))  # the builder's row capacity
            ref = reference.padded_chunk_metadata(
                b.query_start_loc, chunk_size, seqs_out, rows, pad_seq, b.first_seq, b.num_seqs, pad_chunk
            )
            cases.append((b.query_start_loc, b.first_seq, b.num_seqs, rows, seqs_out, pad_seq))
        expected.append((ref.cu_seqlens, ref.chunk_offsets, [list(r) for r in ref.chunk_indices]))
    assert cases
    for case, want, got in zip(cases, expected, run_fill(binary, cases), strict=True):
        assert got == want, f"capacity {capacity}, pad {pad}, {qsl_t}, {shape}: case {case[1:]}"


@pytest.mark.parametrize("pad", [None, *layout.PADS])
@pytest.mark.parametrize("capacity", [1, 33, 64, 200, 1024])
def test_layouts_and_capacities(capacity, pad):
    # 1 and 33: fewer sequences than a warp; 64: one per thread; 200: not a power of two;
    # 1024: four per thread (the 1024 x 64k benchmark's shape)
    check(capacity, pad, "int", count=24)


@pytest.mark.parametrize("pad", [None, *layout.PADS])
def test_int64_offsets_past_int32(pad):
    check(200, pad, "long long", count=24, base=3_000_000_000)


def test_4096_sequences():
    check(4096, None, "int", count=4)  # eight sequences per thread, 512 threads


@pytest.mark.parametrize(
    "shape", [dict(threads=64, block_rows=1024), dict(threads=1024, block_rows=1024), dict(threads=128, block_rows=512)]
)
def test_sweep_launch_shapes(shape):
    check(1024 if shape["threads"] < 1024 else 256, None, "int", count=8, **shape)


@pytest.mark.parametrize("chunk_size", [16, 4096])
def test_other_chunk_sizes(chunk_size):
    check(100, "tail", "int", count=12, chunk_size=chunk_size)


def test_a_sequence_near_the_int32_token_limit():
    # 524,287 rows: wide programs keep the block count (and the test) small
    fill, binary = host_binary(4096, 2, False, "int", threads=256, block_rows=256 * 64)
    q = [5, 5 + 2**31 - 1 - 4096 - 10, 2**31 - 1 - 4096]
    ref = reference.chunk_metadata(q, 4096, 0, 2)
    (got,) = run_fill(binary, [(q, 0, 2, ref.num_chunks, 2, 0)])
    assert got == (ref.cu_seqlens, ref.chunk_offsets, [list(r) for r in ref.chunk_indices])


def test_past_end_padding_rows_are_pad_chunk():
    """``PAD_CHUNK`` reaches every padding row: past_end's rows are ``(0, PAST_END_CHUNK)``."""
    fill, binary = host_binary(64, 4, True, "int", pad_chunk=layout.PAST_END_CHUNK)
    q = [0, 5, 70, 70, 200]
    ((cu, offsets, rows),) = run_fill(binary, [(q, 0, 4, 8, 4, 0)])
    assert rows == [[0, 0], [1, 0], [1, 1], [3, 0], [3, 1], [3, 2], [0, 1 << 20], [0, 1 << 20]]
    assert (cu, offsets) == ([0, 5, 70, 70, 200], [0, 1, 3, 3, 6])


def test_the_harness_catches_a_wrong_kernel(tmp_path):
    """The check is not vacuous: chunk_fill.cu with its row search off by one (``<`` for ``<=``
    in row_search.h), found first on the include path, fails."""
    real = (jit.CSRC / cuda_fill.ROW_SEARCH).read_text()
    broken = real.replace("const bool in_a = a <= r", "const bool in_a = a < r")
    assert broken != real
    (tmp_path / cuda_fill.ROW_SEARCH).write_text(broken)
    for name in ("chunk_fill.cu", cuda_fill.HEADER):
        shutil.copy(jit.CSRC / name, tmp_path / name)
    with pytest.raises(AssertionError, match="capacity 64, pad None"):
        check(64, None, "int", count=8, csrc=tmp_path)


@pytest.mark.parametrize("pad", [None, "tail", "past_end"])
def test_int32_chunk_offsets(pad):
    """``OFFSET_T`` int (a builder's ``offsets_dtype=torch.int32``, CuteDSL GDN's): the same values."""
    check(200, pad, "int", 40, offsets_dtype=torch.int32)

"""Kernel launch configurations swept on one GPU: device µs per build for each (BLOCK_ROWS,
num_warps, SCAN_COLS) of the Triton fill and each (THREADS, BLOCK_ROWS) of the CUDA C fill, per
workload and builder capacity. This is how both fills' defaults were chosen. Diagnostics say where
the time goes: an empty one-program launch (the floor every figure includes, printed per workload
since it drifts), the Triton default without its row search, an I/O floor kernel per fill (the
same loads and stores, with no scan and no search), and an empty CUDA kernel at the CUDA fill's
grid and block.

    python bench/kernel_sweep.py [--default-only] [--out DIR]

--default-only: no Triton configurations. Prints one line per fill and workload and writes the
figures as its record (bench/results.py) to ``DIR/kernel_sweep.runs.jsonl``.
"""

from __future__ import annotations

import argparse
import sys

import results as runs  # bench/results.py: the record format
import torch
import triton
import triton.language as tl
from anchors import empty_kernel

from chunkmeta import reference
from chunkmeta.fill import cuda_fill
from chunkmeta.fill.cuda_fill import CudaFill
from chunkmeta.fill.triton_fill import TritonFill
from chunkmeta.timing import device_us_per_call
from chunkmeta.workloads import workload

CASES = [(1, 4096, 256), (128, 32768, 256), (1024, 65536, 1024), (4096, 1 << 20, 4096)]


def slow_launch_us(launch) -> float:
    """Device µs per call, median of 5 x 200, of a launch that is slow on the host (Triton's JIT,
    ctypes): queued behind a lead long enough that the GPU never waits for the host."""
    return device_us_per_call(launch, calls=200, lead_us=200 * 200.0, repeats=5)


def rows_exact(launch, indices, nt, ref) -> bool:
    """Whether one ``launch`` writes the reference's rows; ref None skips the check."""
    indices.fill_(-1)  # no earlier configuration's rows may pass for this one's
    launch()
    return ref is None or [tuple(r) for r in indices[:nt].tolist()] == ref.chunk_indices


def time_fill(fill, qsl, params, cu, indices, offsets, num_seqs, nt, ref):
    """(device µs per launch, exact?) for one configuration; ref None skips the check."""
    ok = rows_exact(lambda: fill(qsl, params, cu, indices, offsets, 0, num_seqs, nt, num_seqs), indices, nt, ref)
    args = (
        qsl.dtype,
        qsl.data_ptr(),
        params.data_ptr(),
        cu.data_ptr(),
        indices.data_ptr(),
        offsets.data_ptr(),
        0,
        num_seqs,
        nt,
        num_seqs,
        0,
    )
    return device_us_per_call(lambda: fill.launch(*args), calls=200, repeats=5), ok


def no_search_us(fill, tensors) -> float:
    """Where the time goes: the same launch without its row search (its rows are wrong)."""
    no_search = TritonFill(
        chunk_size=64,
        block_seqs=fill.block_seqs,
        padded=False,
        params_on_device=False,
        block_rows=fill.block_rows,
        num_warps=fill.num_warps,
        scan_cols=fill.constexprs["SCAN_COLS"],
        row_search=False,
    )
    return time_fill(no_search, *tensors, None)[0]


@triton.jit
def io_floor_kernel(
    query_start_loc,
    cu_seqlens,
    chunk_indices,
    chunk_offsets,
    num_seqs,
    num_rows,
    BLOCK_SEQS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """The fill's memory traffic alone: every program loads the N + 1 offsets (twice, as the
    fill does), program 0 stores N lengths and N offsets, every program stores its rows; one
    reduction makes the rows depend on all the loads. No scan, no search: its values are
    meaningless."""
    pid = tl.program_id(0)
    seqs = tl.arange(0, BLOCK_SEQS)
    real = seqs < num_seqs
    ends = tl.load(query_start_loc + 1 + seqs, mask=real, other=0)
    lengths = ends - tl.load(query_start_loc + seqs, mask=real, other=0)
    if pid == 0:
        tl.store(cu_seqlens + 1 + seqs, ends, mask=real)
        tl.store(chunk_offsets + 1 + seqs, lengths.to(tl.int64), mask=real)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row = (rows + tl.max(lengths, 0)).to(tl.int64)
    tl.store(chunk_indices.to(tl.pointer_type(tl.int64)) + rows, row, mask=rows < num_rows)


def io_floor_us(fill, qsl, params, cu, indices, offsets, num_seqs, nt) -> float:
    grid = (-(-nt // fill.block_rows),)

    def launch():
        io_floor_kernel[grid](
            qsl,
            cu,
            indices,
            offsets,
            num_seqs,
            nt,
            BLOCK_SEQS=fill.block_seqs,
            BLOCK_ROWS=fill.block_rows,
            num_warps=fill.num_warps,
        )

    launch()
    return slow_launch_us(launch)  # launched through the JIT: tens of µs of host time each


def empty_launch_us(calls: int = 200, lead_us: float = 200 * 200.0) -> float:
    """An empty one-program launch: the launch floor every device figure here includes. Printed
    per case because it drifts on a shared GPU; compare figures with the floor next to them.
    Median of 5 x ``calls`` launches, like the sweep's own figures."""
    x = torch.empty(1, device="cuda")
    empty_kernel[(1,)](x)
    return device_us_per_call(lambda: empty_kernel[(1,)](x), calls=calls, lead_us=lead_us, repeats=5)


def time_cuda_fill(cuda, qsl, params, cu, indices, offsets, num_seqs, nt, ref):
    """(device µs per launch, exact?) for one CUDA C fill shape, launched through ctypes (slow on
    the host: a long queued lead keeps the GPU from waiting on it); None if it cannot compile."""
    kernel = cuda.kernel(qsl.dtype, qsl.device)
    if kernel is None:
        return None
    stream = torch.cuda.current_stream().cuda_stream
    args = (
        qsl.data_ptr(),
        params.data_ptr(),
        cu.data_ptr(),
        indices.data_ptr(),
        offsets.data_ptr(),
        0,
        num_seqs,
        nt,
        num_seqs,
        0,
    )

    def launch():
        cuda.launch(kernel[0], stream, *args)

    ok = rows_exact(launch, indices, nt, ref)
    return slow_launch_us(launch), ok


# (THREADS, BLOCK_ROWS) of the CUDA C fill tried per workload
CUDA_CONFIGS = [
    (threads, rows) for threads in (64, 128, 256, 512, 1024) for rows in (64, 128, 256, 512, 1024) if rows >= threads
]

EMPTY_CUDA = (
    'extern "C" __global__ void empty_fill(const int *a, const int *b, int *c, long long *d, '
    "long long *e, int f, int g, int h, int i, int j) {}"
)


IO_FLOOR_CUDA = r"""
extern "C" __global__ void io_floor_fill(const int *q, const int *params, int *cu, long long *rows,
                                         long long *offsets, int first_seq, int num_seqs, int num_rows,
                                         int seqs_out, int pad_seq) {
  /* the CUDA fill's memory traffic alone, in its layout (SEQ): each thread's offsets loaded, its
     rows stored, then its program's share of cu_seqlens and chunk_offsets; one barrier ties the
     stores to every load */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int starts[SEQS_PER_THREAD], stops[SEQS_PER_THREAD], sum = 0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) starts[j] = SEQ(j) < num_seqs ? q[SEQ(j)] : 0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) stops[j] = SEQ(j) < num_seqs ? q[SEQ(j) + 1] : 0;
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) sum += starts[j] + stops[j];
  const int tied = __syncthreads_or(sum == 0x7fffffff);
#pragma unroll
  for (int k = 0; k < ROWS_PER_THREAD; k++) {
    const int r = blockIdx.x * BLOCK_ROWS + k * THREADS + tid;
    if (r < num_rows) rows[r] = r + tied;
  }
  const int lo = STORES_BEGIN, hi = STORES_END(seqs_out);
#pragma unroll
  for (int j = 0; j < SEQS_PER_THREAD; j++) {
    const int s = SEQ(j);
    if (s >= lo && s < hi) {
      cu[1 + s] = stops[j];
      offsets[1 + s] = starts[j];
    }
  }
}
"""


def diagnostic_cuda_us(body: str, entry: bytes, cuda, grid: int, pointers, int32s) -> float:
    """Device µs per launch of a diagnostic CUDA kernel ``body``, compiled with the defines of the
    CUDA C fill shape ``cuda`` and launched at ``grid`` x its threads."""
    device = torch.device("cuda", torch.cuda.current_device())
    image = cuda_fill.compile_cubin(cuda_fill._source("int", cuda.defines, body), torch.cuda.get_device_capability())
    function = cuda_fill.load_function(image, device, entry)
    stream = torch.cuda.current_stream().cuda_stream
    return slow_launch_us(lambda: cuda_fill.launch(function, grid, cuda.threads, stream, pointers, int32s))


def cuda_figures(capacity, tensors, ref) -> dict | None:
    """The CUDA C fill's default and every shape of CUDA_CONFIGS, fastest first, with its
    diagnostics; None without NVRTC."""
    default = CudaFill(chunk_size=64, block_seqs=capacity, padded=False)
    chosen = time_cuda_fill(default, *tensors, ref)
    if chosen is None:
        return None
    results = []
    for threads, rows in CUDA_CONFIGS:
        timed = time_cuda_fill(
            CudaFill(chunk_size=64, block_seqs=capacity, padded=False, threads=threads, block_rows=rows), *tensors, ref
        )
        results.append((timed, f"{threads}/{rows}"))
    results.sort()
    qsl, params, cu, indices, offsets, num_seqs, nt = tensors
    grid = -(-nt // default.block_rows)
    empty = diagnostic_cuda_us(EMPTY_CUDA, b"empty_fill", default, grid, [0] * 5, [0] * 5)
    pointers = [qsl.data_ptr(), params.data_ptr(), cu.data_ptr(), indices.data_ptr(), offsets.data_ptr()]
    io_floor = diagnostic_cuda_us(
        IO_FLOOR_CUDA, b"io_floor_fill", default, grid, pointers, [0, num_seqs, nt, num_seqs, 0]
    )
    return {
        "default": f"{default.threads}/{default.block_rows}",
        "us": chosen[0],
        "exact": chosen[1],
        "grid": grid,
        "threads": default.threads,
        "empty_kernel": empty,
        "io_floor": io_floor,
        "configs": [[config, us] for (us, _), config in results],
        "wrong": [config for (_, ok), config in results if not ok],
    }


def cuda_line(c: dict | None) -> str:
    if c is None:
        return "CUDA C fill: not available (no NVRTC)"
    return (
        f"CUDA C fill: default {c['default']} {c['us']:.2f}"
        f" (empty kernel, {c['grid']} x {c['threads']} threads: {c['empty_kernel']:.2f}; I/O floor: "
        f"{c['io_floor']:.2f}){'' if c['exact'] else ' WRONG'}"
        + (f"; WRONG: {c['wrong']}" if c["wrong"] else "")
        + " | "
        + "  ".join(f"{config}:{us:.2f}" for config, us in c["configs"][:8])
    )


def triton_line(w: dict) -> str:
    t = w["triton"]
    return (
        f"{w['key']} capacity={w['capacity']} NT={w['num_chunks']}: empty launch {w['empty_launch']:.2f}; default "
        f"{t['default']} {t['us']:.2f}{'' if t['exact'] else ' WRONG'} (no row search: {t['no_row_search']:.2f}; "
        f"I/O floor: {t['io_floor']:.2f})"
        + (f"; WRONG: {t['wrong']}" if t["wrong"] else "")
        + " | "
        + "  ".join(f"{config}:{us:.2f}" for config, us in t["configs"][:10])
    )


# (BLOCK_ROWS, num_warps, SCAN_COLS) tried per workload
CONFIGS = [(rows, warps, cols) for rows in (128, 256, 512) for warps in (4, 8, 16) for cols in (1, 4, 16, 64)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--default-only", action="store_true", help="no Triton configurations")
    parser.add_argument("--out", default="bench_out", help="where its record (kernel_sweep.runs.jsonl) goes")
    args = parser.parse_args(argv)
    print(
        f"# {torch.cuda.get_device_name()}: device µs per build (median of 5 x 200 launches), fastest first; "
        "configs are BLOCK_ROWS/num_warps/SCAN_COLS (Triton) and THREADS/BLOCK_ROWS (CUDA C fill)"
    )
    workloads = []
    for num_seqs, num_tokens, capacity in CASES:
        batch = workload(num_seqs, num_tokens, seed=num_seqs)
        ref = reference.chunk_metadata(batch.query_start_loc, 64)
        qsl = torch.tensor(batch.query_start_loc, dtype=torch.int32, device="cuda")
        nt = ref.num_chunks
        cu = torch.zeros(capacity + 2, dtype=torch.int32, device="cuda")
        offsets = torch.zeros(capacity + 2, dtype=torch.int64, device="cuda")
        indices = torch.zeros(nt + 8, 2, dtype=torch.int32, device="cuda")
        params = torch.zeros(2, dtype=torch.int32, device="cuda")
        tensors = (qsl, params, cu, indices, offsets, num_seqs, nt)
        empty = empty_launch_us()
        results = []
        for block_rows, num_warps, scan_cols in CONFIGS if not args.default_only else ():
            fill = TritonFill(
                chunk_size=64,
                block_seqs=capacity,
                padded=False,
                params_on_device=False,
                block_rows=block_rows,
                num_warps=num_warps,
                scan_cols=scan_cols,
            )
            results.append((time_fill(fill, *tensors, ref), f"{block_rows}/{num_warps}/{scan_cols}"))
        results.sort()
        default = TritonFill(chunk_size=64, block_seqs=capacity, padded=False, params_on_device=False)
        chosen = time_fill(default, *tensors, ref)
        w = {
            "key": f"{num_seqs}x{num_tokens // 1024}k",
            "capacity": capacity,
            "num_chunks": nt,
            "empty_launch": empty,
            "triton": {
                "default": f"{default.block_rows}/{default.num_warps}/{default.constexprs['SCAN_COLS']}",
                "us": chosen[0],
                "exact": chosen[1],
                "no_row_search": no_search_us(default, tensors),
                "io_floor": io_floor_us(default, *tensors),
                "configs": [[config, us] for (us, _), config in results],
                "wrong": [config for (_, ok), config in results if not ok],
            },
        }
        print(triton_line(w))
        w["cuda"] = cuda_figures(capacity, tensors, ref)
        w["empty_launch_after"] = empty_launch_us()
        print(f"    {cuda_line(w['cuda'])}; empty launch {w['empty_launch_after']:.2f}", flush=True)
        workloads.append(w)
    runs.save("kernel_sweep", {"workloads": workloads}, script="bench/kernel_sweep.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

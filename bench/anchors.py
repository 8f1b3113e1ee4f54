"""The methods chunkmeta is measured against (docs/gpu.md says why these), each a callable
``method(cu_seqlens, cu_seqlens_cpu) -> (chunk_indices, chunk_offsets)`` on one step's rebased
prefill ``cu_seqlens`` (device) and its host copy.

* ``fla_sync``   FLA's prepare_chunk_indices + prepare_chunk_offsets on the device cu_seqlens
                 (the ``.tolist()`` sync engines pay today);
* ``fla_host``   the same given ``cu_seqlens_cpu`` (host computation, then a copy to the device);
* ``fla_static`` FLA 0.6.0's prepare_chunk_indices_static (device ops, graph-capturable);
* ``trt_style``  host count + ``repeat_interleave(output_size=)`` on the device (TensorRT-LLM #18064's idea);
* ``rocm_style`` one Triton program per sequence with an exact host count (vLLM #51862's idea),
                 written here from that description;
* ``floor``      two output allocations and one empty Triton launch.

FLA caches its helpers by tensor identity, so callers pass a fresh ``cu_seqlens`` per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _cdiv(a, b):
    return -(-a // b)


def _host_num_chunks(cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> int:
    lengths = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
    return int(((lengths + chunk_size - 1) // chunk_size).sum())


def fla_sync(chunk_size: int):
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    def run(cu_seqlens, cu_seqlens_cpu):
        return prepare_chunk_indices(cu_seqlens, chunk_size), prepare_chunk_offsets(cu_seqlens, chunk_size)

    return run


def fla_host(chunk_size: int):
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    def run(cu_seqlens, cu_seqlens_cpu):
        return (
            prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu),
            prepare_chunk_offsets(cu_seqlens, chunk_size),
        )

    return run


def fla_static(chunk_size: int):
    from fla.ops.utils.index import prepare_chunk_indices_static

    def run(cu_seqlens, cu_seqlens_cpu):
        # nt_max as FLA's use_graph path sizes it for a batch of this many sequences and tokens
        n = cu_seqlens_cpu.shape[0] - 1
        nt_max = _cdiv(int(cu_seqlens_cpu[-1]), chunk_size) + n
        indices, offsets = prepare_chunk_indices_static(cu_seqlens, chunk_size, nt_max)
        return indices, offsets

    return run


def trt_style(chunk_size: int):
    def run(cu_seqlens, cu_seqlens_cpu):
        num_chunks = _host_num_chunks(cu_seqlens_cpu, chunk_size)
        n = cu_seqlens.shape[0] - 1
        seq_chunks = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1, chunk_size, rounding_mode="floor")
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=cu_seqlens.device)
        torch.cumsum(seq_chunks, 0, out=offsets[1:])
        seq = torch.repeat_interleave(torch.arange(n, device=cu_seqlens.device), seq_chunks, output_size=num_chunks)
        chunk = torch.arange(num_chunks, device=cu_seqlens.device) - offsets[seq]
        return torch.stack([seq, chunk], 1).to(torch.int32), offsets

    return run


@triton.jit
def _per_sequence_kernel(
    cu_seqlens, chunk_indices, chunk_offsets, num_seqs, CHUNK_SIZE: tl.constexpr, BLOCK: tl.constexpr
):
    # program i: its first row = sum of cdiv(len_j, C) over j < i (each program rescans: O(N^2)),
    # then its own rows, BLOCK at a time.
    i = tl.program_id(0)
    offset = 0
    for start in range(0, i, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < i
        lengths = tl.load(cu_seqlens + j + 1, mask=mask, other=0) - tl.load(cu_seqlens + j, mask=mask, other=0)
        offset += tl.sum((lengths + CHUNK_SIZE - 1) // CHUNK_SIZE, 0)
    length = tl.load(cu_seqlens + i + 1) - tl.load(cu_seqlens + i)
    count = (length + CHUNK_SIZE - 1) // CHUNK_SIZE
    tl.store(chunk_offsets + i + 1, (offset + count).to(tl.int64))
    for start in range(0, count, BLOCK):
        t = start + tl.arange(0, BLOCK)
        mask = t < count
        tl.store(chunk_indices + 2 * (offset + t), i + 0 * t, mask=mask)
        tl.store(chunk_indices + 2 * (offset + t) + 1, t, mask=mask)


def rocm_style(chunk_size: int):
    def run(cu_seqlens, cu_seqlens_cpu):
        num_chunks = _host_num_chunks(cu_seqlens_cpu, chunk_size)
        n = cu_seqlens.shape[0] - 1
        indices = torch.empty(num_chunks, 2, dtype=torch.int32, device=cu_seqlens.device)
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=cu_seqlens.device)
        if n:
            _per_sequence_kernel[(n,)](cu_seqlens, indices, offsets, n, CHUNK_SIZE=chunk_size, BLOCK=256)
        return indices, offsets

    return run


@triton.jit
def empty_kernel(x):  # also bench/diagnostics/launch_floor.py's
    pass


def floor(chunk_size: int):
    def run(cu_seqlens, cu_seqlens_cpu):
        num_chunks = _cdiv(int(cu_seqlens_cpu[-1]), chunk_size) + cu_seqlens_cpu.shape[0] - 1
        indices = torch.empty(num_chunks, 2, dtype=torch.int32, device=cu_seqlens.device)
        offsets = torch.empty(cu_seqlens.shape[0], dtype=torch.int64, device=cu_seqlens.device)
        empty_kernel[(1,)](indices)
        return indices, offsets

    return run


ANCHORS = {
    "fla_sync": fla_sync,
    "fla_host": fla_host,
    "fla_static": fla_static,
    "trt_style": trt_style,
    "rocm_style": rocm_style,
    "floor": floor,
}

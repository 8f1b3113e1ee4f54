"""chunkmeta.fill.cuda_fill on the host: when the C build may use the CUDA C step fill, and its
launch shapes. (It runs on the GPU in tests/core/test_gpu.py; it compiles for sm_90 in
tests/kernels/test_kernel_compiles.py.)"""

import pytest
import torch

from chunkmeta.fill import cuda_fill
from chunkmeta.fill.cuda_fill import CudaStepFill

CUDA0 = torch.device("cuda", 0)


ENTRIES = [(1, 6, 0, 1, 0, 0, 64, 128, 0, 0, 0, 0)]  # one FLA entry (chunkmeta.tables.Entry's fields)


@pytest.mark.parametrize(
    "capacity, threads, block_rows", [(1, 32, 256), (200, 256, 256), (1024, 256, 256), (4096, 512, 512)]
)
def test_step_fill_shapes(capacity, threads, block_rows):
    """The step fill's defaults (bench/results/step_fill_sweep-2026-12-02*.json), and another
    shape as the step fill sweep asks for one: its defines follow."""
    fill = CudaStepFill(entries=ENTRIES, block_seqs=capacity, padded=False)
    assert (fill.threads, fill.block_rows) == (threads, block_rows)
    other = CudaStepFill(entries=ENTRIES, block_seqs=capacity, padded=False, threads=32, block_rows=64)
    assert dict(other.defines)["THREADS"] == 32 and dict(other.defines)["BLOCK_ROWS"] == 64
    # not a power of two, too few, more than the sequence lanes, rows not a multiple
    for threads, rows in ((48, 96), (16, 64), (2 * max(capacity, 32), 16384), (64, 96)):
        with pytest.raises(ValueError):
            CudaStepFill(entries=ENTRIES, block_seqs=capacity, padded=False, threads=threads, block_rows=rows)


def test_no_kernel_where_it_cannot_run(monkeypatch):
    """None (the C build then launches the Triton kernel) off CUDA, past the shared-memory
    limit, for other input dtypes, and when switched off; none of these touch CUDA or NVRTC."""
    small = CudaStepFill(entries=ENTRIES, block_seqs=64, padded=False)
    assert small.kernel((torch.int32,) * 3, torch.device("cpu")) is None
    assert small.kernel((torch.int16, torch.int32, torch.int32), CUDA0) is None
    assert CudaStepFill(entries=ENTRIES, block_seqs=8193, padded=False).kernel((torch.int32,) * 3, CUDA0) is None
    monkeypatch.setenv("CHUNKMETA_CUDA_FILL", "0")
    assert small.kernel((torch.int32,) * 3, CUDA0) is None


def test_source_defines_its_dtypes_and_shape():
    fill = CudaStepFill(entries=ENTRIES, block_seqs=300, padded=True)
    source = fill.source((torch.int64, torch.int32, torch.int64)).decode()
    for line in (
        "#define QSL_T long long",
        "#define COMP_T int",
        "#define CKPT_T long long",
        "#define SEQ_LANES 512",
        "#define THREADS 256",
        "#define BLOCK_ROWS 256",
        "#define PADDED 1",
        "#define NUM_ENTRIES 1",
        "#define ENTRIES {1,6,0,1,0,0,64,128,0,0,0,0}",
    ):
        assert line in source


def test_any_compile_or_load_failure_means_no_kernel(monkeypatch):
    """Whatever fails while compiling or loading (here: an NVRTC without an entry point), the
    answer is None, cached, and the C build falls back to the Triton kernel; nothing raises."""
    calls = []

    def broken(*args):
        calls.append(args)
        raise AttributeError("nvrtcGetCUBIN")

    monkeypatch.setattr(cuda_fill, "compile_step_cubin", broken)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fill = CudaStepFill(entries=ENTRIES, block_seqs=96, padded=True)  # a shape no other test compiles
    assert fill.kernel((torch.int64,) * 3, CUDA0) is None
    assert fill.kernel((torch.int64,) * 3, CUDA0) is None
    assert len(calls) == 1

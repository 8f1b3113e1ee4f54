"""The kernel compiles for a Hopper GPU (sm_90) in every configuration the launchers choose.

CPU tests run the kernel under Triton's interpreter, which executes it as Python and so accepts
code the GPU compiler rejects (a name bound in only one branch of an ``if``, say). This compiles
it for real, without a GPU, in a subprocess (this process has ``TRITON_INTERPRET=1`` set, which
turns every kernel into an interpreted one), so such an error fails here instead of on the
first CUDA build.

Triton's compiler differs between versions (3.6 asserts on a warp-local gather that 3.9
compiles), and engines ship older Tritons than the newest one `make test` installs:
`make test-triton-compat` runs this file under Triton 3.6 too.

The CUDA C step fill (``chunkmeta.fill.cuda_fill``) is compiled here too, by NVRTC, in every launch shape
its builder and the sweep use. NVRTC is not part of `make test`'s venv (the CPU torch does not
need it); `make test-triton-compat` installs the nvidia-cuda-nvrtc wheel of CUDA 13.0, the one
torch 2.11's CUDA 13.0 build depends on, and requires it.
"""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chunkmeta import tables
from chunkmeta.fill.step_fill import StepFill, step_tables_kernel

step_ints = ("first_seq", "num_seqs", "batch_seqs", "rows0", "rows1", "rows2", "rows3", "rows4", "rows5")
step_signature = {"query_start_loc": "*i32", "num_computed_tokens": "*i64", "checkpoint_offsets": "*i32",
                  "arena": "*u8", "step_params": "*i32", **{name: "i32" for name in step_ints}}
def compile(fill):
    full = dict(step_signature, **{name: "constexpr" for name in fill.constexprs})
    return triton.compile(ASTSource(step_tables_kernel, full, dict(fill.constexprs)),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": fill.num_warps})

# one FLA entry (ChunkMetadataBuilder's, its graph mode's, a bounded build's, the one-shot's) at
# capacities giving each block shape the launchers choose
for capacity in (64, 1024, 4096):
    fla = tables.slot_layout({"fla": tables.Fla(64)}, capacity, 65536, "negative").entries
    for entries, padded, on_device in ((fla, False, False), (fla, True, False), (fla, True, True),
                                       (tables.bounded_entries(fla), True, False)):
        fill = StepFill(entries=entries, block_seqs=capacity, padded=padded, params_on_device=on_device)
        print("compiled fla", capacity, padded, on_device, fill.block_rows, compile(fill).metadata.num_warps)
    for indices_dtype in (torch.int32, torch.int64):
        entry = tables.one_shot_layout(64, capacity, indices_dtype).entry
        compile(StepFill(entries=(entry,), block_seqs=capacity, padded=False))
        print("compiled one-shot", capacity, indices_dtype)
# shapes the sweeps tried: row groups wider and narrower than the row search's coarse ends
fla = tables.slot_layout({"fla": tables.Fla(64)}, 256, 8192, "tail").entries
for block_rows, num_warps, scan_cols in ((128, 4, 16), (512, 16, 64), (128, 16, 1), (512, 4, 4)):
    compile(StepFill(entries=fla, block_seqs=256, padded=False, block_rows=block_rows, num_warps=num_warps,
                     scan_cols=scan_cols))
    print("compiled", 256, block_rows, num_warps, scan_cols)

# the step kernel (chunkmeta.fill.step_fill): every entry kind, in both layouts, at three capacities,
# with int64 per-row inputs where an engine passes them
specs = {"fla": tables.Fla(64), "fla_batch": tables.Fla(64, rows="batch", offsets_dtype=torch.int32),
         "conv": tables.Conv(), "mamba2": tables.Mamba2(chunk_size=256, checkpoints=True),
         "sglang": tables.SglangMamba2(chunk_size=64)}
for capacity in (64, 1024, 4096):
    entries = tables.slot_layout(specs, capacity, 65536, "tail").entries
    for padded, on_device in ((False, False), (True, False), (True, True)):
        fill = StepFill(entries=entries, block_seqs=capacity, padded=padded, params_on_device=on_device)
        full = dict(step_signature, **{name: "constexpr" for name in fill.constexprs})
        triton.compile(ASTSource(step_tables_kernel, full, dict(fill.constexprs)), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": fill.num_warps})
        print("compiled step", capacity, padded, on_device)
paired = tables.slot_layout({"conv": tables.Conv(paired=True), "mamba2": tables.Mamba2()}, 256, 8192, "tail")
fill = StepFill(entries=paired.entries, block_seqs=256, padded=False)
full = dict(step_signature, **{name: "constexpr" for name in fill.constexprs})
triton.compile(ASTSource(step_tables_kernel, full, dict(fill.constexprs)), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": fill.num_warps})
print("compiled step paired")
"""


def cannot_compile(reason: str) -> None:
    """Skip: this machine cannot compile for sm_90. Fail instead where the compile is the point
    (make test-triton-compat sets CHUNKMETA_REQUIRE_SM90_COMPILE=1)."""
    if os.environ.get("CHUNKMETA_REQUIRE_SM90_COMPILE") == "1":
        pytest.fail(f"CHUNKMETA_REQUIRE_SM90_COMPILE=1 and {reason}")
    pytest.skip(reason)


def test_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    missing = (
        "cannot find ptxas",
        "ptxas not found",
        "no such file",
        "cannot import name 'gputarget'",
        "cannot import name 'astsource'",
    )
    if done.returncode and any(text in done.stderr.lower() for text in missing):
        # a Triton without the CUDA toolchain or these entry points; a failing compile still fails
        cannot_compile(f"this Triton cannot compile for sm_90 here: {done.stderr[-600:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 3 * 6 + 4 + 3 * 3 + 1, done.stdout


def test_cuda_fla_fills_compile_for_sm90():
    """The CUDA C step fill of one FLA entry, by NVRTC, in every launch shape its builders and the
    sweep use: ChunkMetadataBuilder's layouts, a bounded build's, the one-shot's buckets."""
    import torch

    from chunkmeta import tables
    from chunkmeta.fill import cuda_fill

    if cuda_fill.nvrtc_version() is None:
        cannot_compile("no NVRTC here (make test-triton-compat installs it)")
    for capacity in (1, 64, 200, 1024, 4096, 8192):
        fla = tables.slot_layout({"fla": tables.Fla(64)}, capacity, 65536, "past_end").entries
        one_shot = [
            (tables.one_shot_layout(64, max(16, capacity), dtype).entry,) for dtype in (torch.int32, torch.int64)
        ]
        for entries, padded in (
            (fla, False),
            (fla, True),
            (tables.bounded_entries(fla), True),
            *[(e, False) for e in one_shot],
        ):
            fill = cuda_fill.CudaStepFill(entries=entries, block_seqs=capacity, padded=padded)
            for dtype in (torch.int32, torch.int64):
                cubin = cuda_fill.compile_step_cubin(fill.source((dtype,) * 3), (9, 0))
                assert cubin[:4] == b"\x7fELF", (capacity, padded, dtype)


def test_cuda_step_fill_compiles_for_sm90():
    """The CUDA C step fill, by NVRTC, at three capacities, every layout and input dtype mix."""
    import torch

    from chunkmeta import tables
    from chunkmeta.fill import cuda_fill

    if cuda_fill.nvrtc_version() is None:
        cannot_compile("no NVRTC here (make test-triton-compat installs it)")
    specs = {
        "fla": tables.Fla(64),
        "fla_batch": tables.Fla(64, rows="batch", offsets_dtype=torch.int32),
        "conv": tables.Conv(),
        "mamba2": tables.Mamba2(chunk_size=256, checkpoints=True),
        "sglang": tables.SglangMamba2(chunk_size=64),
    }
    for capacity in (1, 1024, 4096):
        entries = tables.slot_layout(specs, capacity, 65536, "tail").entries
        for padded, on_device in ((False, False), (True, False), (True, True)):
            fill = cuda_fill.CudaStepFill(
                entries=entries, block_seqs=capacity, padded=padded, params_on_device=on_device
            )
            for dtypes in ((torch.int32,) * 3, (torch.int64, torch.int64, torch.int32)):
                cubin = cuda_fill.compile_step_cubin(fill.source(dtypes), (9, 0))
                assert cubin[:4] == b"\x7fELF", (capacity, padded, dtypes)

"""GPU (``-m gpu``; skipped without CUDA or SGLang): a Mamba2 forward's metadata and SGLang's SSD op
fed with it, under ``torch.cuda.set_sync_debug_mode("error")``.

chunkmeta's ``Mamba2AttnBackend`` subclass builds the forward's metadata (batches with and without
cached prefixes); then SGLang's own ``mamba_chunk_scan_combined``
(``kernels/ops/mamba/triton_ops/ssd_combined.py``, what ``MambaMixer2.forward`` calls in 0.5.23)
runs on it as the mixer calls it. Both must not sync (one warm-up run first: Triton compiles and
autotunes there), and the op's outputs must equal those it gives on SGLang's own ``prepare_mixed``
metadata. Needs the SGLang package importable (a carried .py-only copy will do, with the
pure-Python dependencies its ForwardBatch imports: see the Makefile's SGLANG_DEPS).
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not importable", allow_module_level=True)

import test_sglang_mamba2_real as harness  # installs the torchvision stubs before SGLang imports
from checks import no_sync
from chunkmeta.integrations import sglang as sg
from chunkmeta.integrations.sglang.mamba2 import Mamba2ChunkMeta

ssd = pytest.importorskip("sglang.kernels.ops.mamba.triton_ops.ssd_combined")

HEADS, HEAD_DIM, GROUPS, STATE = 4, 32, 1, 16


def cuda_batch(lens, prefix):
    batch = harness.forward_batch(lens, prefix)
    for name in (
        "input_ids",
        "req_pool_indices",
        "seq_lens",
        "out_cache_loc",
        "extend_seq_lens",
        "extend_prefix_lens",
        "extend_start_loc",
    ):
        setattr(batch, name, getattr(batch, name).cuda())
    return batch


def backends(chunk_size):
    ours = harness.mamba2_backend(sg.chunkmeta_backend(harness.STOCK_MAMBA2, kind="mamba2"), chunk_size)
    stock = harness.mamba2_backend(harness.STOCK_MAMBA2, chunk_size)
    ours.device = stock.device = torch.device("cuda")
    ours.chunkmeta = Mamba2ChunkMeta(device="cuda", max_num_seqs=64, max_num_tokens=1 << 14)
    return ours, stock


def scan(metadata, inputs, ssm_state):
    """The SSD call of MambaMixer2.forward on a forward's metadata (prefill rows)."""
    mixed = metadata.mixed_metadata
    x, dt, A, B, C, D, dt_bias = inputs
    slots = metadata.mamba_cache_indices[: metadata.num_prefills].long()
    initial = None
    if mixed.prep_initial_states:
        initial = torch.where(mixed.has_initial_states[:, None, None, None], ssm_state[slots], 0)
    tokens = metadata.num_prefill_tokens
    out = torch.empty(1, tokens, HEADS, HEAD_DIM, device="cuda", dtype=x.dtype)
    _, varlen, _ = ssd.mamba_chunk_scan_combined(
        x.view(1, tokens, HEADS, HEAD_DIM),
        dt.unsqueeze(0),
        A,
        B.view(1, tokens, GROUPS, STATE),
        C.view(1, tokens, GROUPS, STATE),
        chunk_size=mixed.chunk_size,
        D=D,
        z=None,
        dt_bias=dt_bias,
        seq_idx=mixed.seq_idx,
        chunk_indices=mixed.chunk_indices,
        chunk_offsets=mixed.chunk_offsets,
        cu_seqlens=metadata.query_start_loc,
        initial_states=initial,
        return_varlen_states=True,
        return_final_states=False,
        return_track_states=True,
        dt_softplus=True,
        dt_limit=(0.0, float("inf")),
        out=out,
        state_dtype=ssm_state.dtype,
    )
    return out, varlen


@pytest.mark.parametrize("prefix", [[0, 0, 0, 0], [0, 100, 7, 64]])
@pytest.mark.parametrize("chunk_size", [64, 256])
def test_mamba2_forward_metadata_and_ssd_do_not_sync(prefix, chunk_size):
    lens = [300, 1, 65, 17]
    tokens = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)

    inputs = (
        rand(tokens, HEADS * HEAD_DIM).bfloat16(),
        rand(tokens, HEADS).bfloat16(),
        -rand(HEADS).abs(),
        rand(tokens, GROUPS * STATE).bfloat16(),
        rand(tokens, GROUPS * STATE).bfloat16(),
        rand(HEADS),
        rand(HEADS),
    )
    ssm_state = rand(harness.Pool.size + 1, HEADS, HEAD_DIM, STATE)
    ours, stock = backends(chunk_size)
    stock.init_forward_metadata(cuda_batch(lens, prefix))
    want = scan(stock.forward_metadata, inputs, ssm_state)
    ours.init_forward_metadata(cuda_batch(lens, prefix))  # first build, and Triton's compile/autotune
    scan(ours.forward_metadata, inputs, ssm_state)
    batch = cuda_batch(lens, prefix)
    torch.cuda.synchronize()
    with no_sync():
        ours.init_forward_metadata(batch)
        got = scan(ours.forward_metadata, inputs, ssm_state)
    torch.cuda.synchronize()
    harness.assert_same(ours.forward_metadata, stock.forward_metadata)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.chunkmeta.counts["mamba2"] == 2

"""The KDA/GDN adapter against FLA's real kernels.

CPU (in `make test`): FLA 0.6.0's forwards under Triton's interpreter, float32, small shapes —
outputs and final states bit-identical to FLA's own path (FLA deriving its metadata), for the
exact layout, the tail-padded layout and KDA's use_graph layout, and through patch_fla.
GPU (`-m gpu`): bf16 at realistic shapes, bit-identical, and no sync in the forward.
"""

import pytest
import torch
import torch.nn.functional as F

from checks import no_sync, tensors_for
from chunkmeta import ChunkMetadataBuilder, ChunkMetaError, ChunkMetaService, StepBatch
from chunkmeta.workloads import from_lengths

pytest.importorskip("fla")
kda = pytest.importorskip("chunkmeta.integrations.kda")

ON_CPU = not torch.cuda.is_available()
if ON_CPU:
    import fla_interp

    fla_interp.apply()

import fla.ops.gated_delta_rule as fla_gdn  # noqa: E402
import fla.ops.kda as fla_kda  # noqa: E402

H, K = 2, 32
# two decodes, then prefills of 70, 0 and 130 tokens: T = 200, one zero-length sequence
BATCH = from_lengths([1, 1, 70, 0, 130], first_seq=2)
KDA_KW = dict(
    use_qk_l2norm_in_kernel=True,
    use_beta_sigmoid_in_kernel=True,
    safe_gate=True,
    lower_bound=-5.0,
    output_final_state=True,
)
GDN_KW = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)

pytestmark = pytest.mark.fla


def inputs(num_tokens, num_states, device="cpu", dtype=torch.float32, heads=H, dim=K, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    return dict(
        q=rnd(1, num_tokens, heads, dim).to(dtype),
        k=rnd(1, num_tokens, heads, dim).to(dtype),
        v=rnd(1, num_tokens, heads, dim).to(dtype),
        g_kda=(-5.0 * torch.sigmoid(rnd(1, num_tokens, heads, dim))).to(dtype),  # safe_gate: gates in (-5, 0)
        g_gdn=F.logsigmoid(rnd(1, num_tokens, heads)).to(dtype),
        beta=rnd(1, num_tokens, heads).to(dtype),
        h0=rnd(num_states, heads, dim, dim),  # float32: FLA asserts it for KDA
    )


def fla_cu(batch, device="cpu"):
    """The rebased cu_seqlens an engine would hand FLA (a fresh tensor: FLA caches by identity)."""
    q = batch.query_start_loc
    cu = [q[batch.first_seq + i] - q[batch.first_seq] for i in range(batch.num_seqs + 1)]
    return torch.tensor(cu, dtype=torch.int32, device=device)


@pytest.fixture(scope="module")
def x():
    return inputs(BATCH.num_tokens, 8)


@pytest.fixture(scope="module")
def fla_kda_ref(x):
    return fla_kda.chunk_kda(
        x["q"], x["k"], x["v"], x["g_kda"], x["beta"], initial_state=x["h0"][:3], cu_seqlens=fla_cu(BATCH), **KDA_KW
    )


@pytest.fixture(scope="module")
def fla_gdn_ref(x):
    return fla_gdn.chunk_gated_delta_rule(
        x["q"],
        x["k"],
        x["v"],
        x["g_gdn"],
        torch.sigmoid(x["beta"]),
        initial_state=x["h0"][:3],
        cu_seqlens=fla_cu(BATCH),
        **GDN_KW,
    )


def builder(**kw):
    return ChunkMetadataBuilder(4, 256, device="cpu", **kw)


def run_kda(x, md, states):
    before = kda.router_hits()
    o, ht = kda.chunk_kda(
        x["q"], x["k"], x["v"], x["g_kda"], x["beta"], metadata=md, initial_state=x["h0"][:states], **KDA_KW
    )
    assert kda.router_hits() > before, "FLA derived its own metadata instead of using ours"
    return o, ht


def test_kda_exact_layout_is_bit_identical(x, fla_kda_ref):
    md = builder().build(*tensors_for(BATCH), first_seq=BATCH.first_seq)
    o, ht = run_kda(x, md, 3)
    assert torch.equal(o, fla_kda_ref[0]) and torch.equal(ht, fla_kda_ref[1])


def test_kda_tail_padded_layout_is_bit_identical(x, fla_kda_ref):
    b = builder()
    md = b.build_padded(*tensors_for(BATCH), first_seq=BATCH.first_seq, pad="tail")
    states = b.padded_num_seqs["tail"]  # one initial state per padded sequence
    o, ht = run_kda(x, md, states)
    assert torch.equal(o, fla_kda_ref[0])
    assert torch.equal(ht[:3], fla_kda_ref[1])
    assert torch.equal(ht[3:], x["h0"][3:states])  # zero-length tails keep their state


def test_kda_use_graph_layout_is_bit_identical(x, fla_kda_ref):
    b = builder()
    md = b.build_padded(*tensors_for(BATCH), first_seq=BATCH.first_seq, pad="negative")
    states = b.padded_num_seqs["negative"]
    o, ht = run_kda(x, md, states)
    assert torch.equal(o, fla_kda_ref[0]) and torch.equal(ht[:3], fla_kda_ref[1])


def test_gdn_exact_and_tail_padded_are_bit_identical(x, fla_gdn_ref):
    b = builder()
    for md, states in (
        (b.build(*tensors_for(BATCH), first_seq=2), 3),
        (b.build_padded(*tensors_for(BATCH), first_seq=2, pad="tail"), 5),
    ):
        before = kda.router_hits()
        o, ht = kda.chunk_gated_delta_rule(
            x["q"],
            x["k"],
            x["v"],
            x["g_gdn"],
            torch.sigmoid(x["beta"]),
            metadata=md,
            initial_state=x["h0"][:states],
            **GDN_KW,
        )
        assert kda.router_hits() > before  # chunk_offsets came from us too
        assert torch.equal(o, fla_gdn_ref[0]) and torch.equal(ht[:3], fla_gdn_ref[1])


def test_patch_fla_serves_unmodified_callers(x, fla_kda_ref):
    service = ChunkMetaService(4, 256, device="cpu")
    kda.restore_fla()
    original = fla_kda.chunk.prepare_chunk_indices
    with kda.patch_fla(service):
        assert fla_kda.chunk.prepare_chunk_indices is not original
        with service.step(StepBatch(*tensors_for(BATCH), first_seq=2)) as md:
            before = kda.router_hits()
            # an engine's own call site: FLA's public API, given the step's cu_seqlens
            o, ht = fla_kda.chunk_kda(
                x["q"],
                x["k"],
                x["v"],
                x["g_kda"],
                x["beta"],
                initial_state=x["h0"][:3],
                cu_seqlens=md.cu_seqlens,
                **KDA_KW,
            )
            assert kda.router_hits() == before + 2  # chunk_indices and chunk_offsets
        assert torch.equal(o, fla_kda_ref[0]) and torch.equal(ht, fla_kda_ref[1])
        # no open step: FLA derives its own
        before = kda.router_hits()
        fla_kda.chunk.prepare_chunk_indices(fla_cu(BATCH), 64)
        assert kda.router_hits() == before
    assert fla_kda.chunk.prepare_chunk_indices is original  # uninstalled: nobody else installed them
    with service.step(StepBatch(*tensors_for(BATCH), first_seq=2)) as md:  # no longer served
        before = kda.router_hits()
        fla_kda.chunk.prepare_chunk_indices(md.cu_seqlens, 64)
        assert kda.router_hits() == before


def test_adapters_keep_wrappers_installed_and_restore_fla_removes_them(x):
    md = builder().build(*tensors_for(BATCH), first_seq=2)
    original = fla_kda.chunk.prepare_chunk_indices
    kda.restore_fla()
    assert fla_kda.chunk.prepare_chunk_indices is original
    run_kda(x, md, 3)
    assert fla_kda.chunk.prepare_chunk_indices is not original  # stays for later calls
    before = kda.router_hits()
    fla_kda.chunk.prepare_chunk_indices(fla_cu(BATCH), 64)  # not ours: falls through to FLA
    assert kda.router_hits() == before
    kda.restore_fla()
    assert fla_kda.chunk.prepare_chunk_indices is original


def test_adapter_errors():
    md = builder().build(*tensors_for(BATCH), first_seq=2)
    x = inputs(BATCH.num_tokens, 3)
    with pytest.raises(ChunkMetaError, match="cu_seqlens= comes from metadata"):
        kda.chunk_kda(x["q"], x["k"], x["v"], x["g_kda"], x["beta"], metadata=md, cu_seqlens=md.cu_seqlens)
    negative = builder().build_padded(*tensors_for(BATCH), first_seq=2, pad="negative")
    with pytest.raises(ChunkMetaError, match="pad='tail'"):
        kda.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g_gdn"], x["beta"], metadata=negative)
    with pytest.raises(ChunkMetaError, match="pass the step's ChunkMetadata"):
        kda.chunk_kda(x["q"], x["k"], x["v"], x["g_kda"], x["beta"], metadata=None)


def test_retired_metadata_is_refused():
    service = ChunkMetaService(4, 256, device="cpu", strict=True)
    with service.step(StepBatch(*tensors_for(BATCH), first_seq=2)) as md:
        pass
    x = inputs(BATCH.num_tokens, 3)
    with pytest.raises(ChunkMetaError, match="retired"):
        kda.chunk_kda(x["q"], x["k"], x["v"], x["g_kda"], x["beta"], metadata=md, initial_state=x["h0"][:3])


def test_unsupported_fla_version_is_a_clear_error(monkeypatch):
    from chunkmeta.integrations.fla import forwards

    monkeypatch.setattr(forwards, "fla_version", lambda: "0.5.0")
    md = builder().build(*tensors_for(BATCH), first_seq=2)
    x = inputs(BATCH.num_tokens, 3)
    with pytest.raises(ChunkMetaError, match="fla-core 0.5.0 is untested .* supports 0.6.0"):
        kda.chunk_kda(x["q"], x["k"], x["v"], x["g_kda"], x["beta"], metadata=md, initial_state=x["h0"][:3])


# -- GPU -------------------------------------------------------------------------------------

GPU_BATCHES = [
    [4096],
    [1, 1, 300, 0, 2000, 65],
    [1] * 8 + [777] * 8,
    [128] * 64 + [0] * 8 + [100] * 56,
    [8192, 8192, 8192, 8192],
]


def assert_bit_identical_without_sync(batch, args, h0, fla_forward, our_forward, kw):
    """FLA's own path (deriving its metadata) is the reference; ours builds and runs under the
    sync check, after one warm-up call (Triton autotuning syncs)."""
    builder_ = ChunkMetadataBuilder(128, 32768, device="cuda")
    qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    qsl = qsl_cpu.cuda()
    ref_o, ref_ht = fla_forward(*args, initial_state=h0, cu_seqlens=fla_cu(batch, "cuda"), **kw)
    our_forward(*args, metadata=builder_.build(qsl, qsl_cpu), initial_state=h0, **kw)
    with no_sync():
        o, ht = our_forward(*args, metadata=builder_.build(qsl, qsl_cpu), initial_state=h0, **kw)
    assert torch.equal(o, ref_o) and torch.equal(ht, ref_ht)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", GPU_BATCHES, ids=lambda L: f"{len(L)}seqs-{sum(L)}tok")
def test_kda_gpu_bf16_bit_identical_and_sync_free(lengths):
    batch = from_lengths(lengths)
    x = inputs(batch.num_tokens, batch.num_seqs, device="cuda", dtype=torch.bfloat16, heads=32, dim=128)
    args = (x["q"], x["k"], x["v"], x["g_kda"], x["beta"])
    assert_bit_identical_without_sync(batch, args, x["h0"], fla_kda.chunk_kda, kda.chunk_kda, KDA_KW)


@pytest.mark.gpu
def test_gdn_gpu_bf16_bit_identical_and_sync_free():
    batch = from_lengths([1, 1, 300, 0, 2000, 65, 4096])
    x = inputs(batch.num_tokens, batch.num_seqs, device="cuda", dtype=torch.bfloat16, heads=16, dim=128)
    args = (x["q"], x["k"], x["v"], x["g_gdn"], torch.sigmoid(x["beta"]))
    assert_bit_identical_without_sync(
        batch, args, x["h0"], fla_gdn.chunk_gated_delta_rule, kda.chunk_gated_delta_rule, GDN_KW
    )

"""``integrations/vllm/mixed_step`` without vLLM (`make test`): a bucket's tables and inputs
against ``chunkmeta.reference`` on random batches, at fixed addresses and shapes; bad input
refused with nothing written; the graph-safe forwards hand vLLM's ops the same shapes whatever
the batch, and the bucket's tables through the router. The forwards' arithmetic against vLLM's
own ops: ``test_vllm_full_graph_smoke.py`` (`make test-vllm`)."""

import contextlib

import numpy as np
import pytest
import torch

from chunkmeta import reference
from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.vllm import mixed_step
from chunkmeta.integrations.vllm.mixed_step import GdnOps, KdaOps, MixedStepInputs

TOKENS, REQS = 96, 8


def random_step(rng, reqs_max=REQS, tokens_max=TOKENS):
    n = int(rng.integers(1, reqs_max + 1))
    lens = rng.multinomial(int(rng.integers(0, tokens_max + 1)), [1 / n] * n)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(np.cumsum(lens), dtype=torch.int32)
    states = torch.tensor(rng.choice(np.arange(1, 100), size=n, replace=False), dtype=torch.int32)
    computed = torch.tensor(rng.integers(0, 3, size=n) * rng.integers(0, 500, size=n), dtype=torch.int32)
    return qsl, states, computed


def addresses(bucket):
    tensors = (bucket.cu_seqlens, bucket.chunk_indices, bucket.chunk_offsets, bucket.state_indices,
               bucket.has_initial_state, bucket.conv.batch_ptr, bucket.conv.token_chunk_offset_ptr)  # fmt: skip
    return [(t.shape, t.dtype, t.data_ptr()) for t in tensors], bucket.conv.nums_dict[8]["tot"]


def shared_fill(shared: bool):
    """A fill larger than the tests' bucket (the largest bucket's, as a builder shares it), or None."""
    return mixed_step.SharedFill(4 * TOKENS, 4 * REQS) if shared else None


def tail_seq(fill) -> int:
    """The sequence the padding rows point at: the fill's tail, or the bucket's own."""
    return REQS if fill is None else fill.num_reqs


@pytest.mark.parametrize("shared", [False, True])
def test_staged_steps_match_the_reference_at_fixed_addresses(shared):
    fill = shared_fill(shared)
    bucket = MixedStepInputs(TOKENS, REQS, "cpu", fill=fill)
    if shared:  # a smaller bucket staged between this one's steps: it writes the same tables
        other = MixedStepInputs(TOKENS // 2, REQS // 2, "cpu", fill=fill)
        assert other.builder is bucket.builder
    fixed = addresses(bucket)
    rows = bucket.chunk_indices.shape[0]
    rng = np.random.default_rng(3)
    for _ in range(60):
        qsl, states, computed = random_step(rng)
        n = qsl.shape[0] - 1
        if shared:
            small_qsl, *small = random_step(rng, REQS // 2, TOKENS // 2)
            other.stage(small_qsl, small_qsl, *small)
        bucket.stage(qsl, qsl, states, computed)
        assert addresses(bucket) == fixed
        want = reference.padded_chunk_metadata(qsl.tolist(), 64, REQS + 1, rows, pad_seq=tail_seq(fill))
        assert bucket.cu_seqlens.tolist() == want.cu_seqlens[: REQS + 1]
        assert [tuple(r) for r in bucket.chunk_indices.tolist()] == [tuple(r) for r in want.chunk_indices]
        assert bucket.chunk_offsets[: REQS + 1].tolist() == want.chunk_offsets[: REQS + 1]
        conv = reference.causal_conv1d_metadata(qsl.tolist())
        tail = [-1] * (bucket.conv.batch_ptr.shape[0] - conv.tot)
        assert bucket.conv.batch_ptr.tolist() == conv.batch_ptr + tail
        assert bucket.conv.token_chunk_offset_ptr.tolist() == conv.token_chunk_offset_ptr + tail
        assert bucket.state_indices.tolist() == states.tolist() + [mixed_step.NULL_BLOCK_ID] * (REQS - n)
        assert bucket.has_initial_state.tolist() == (computed > 0).tolist() + [False] * (REQS - n)
        assert bucket.staged.fla.is_live


@pytest.mark.parametrize("shared", [False, True])
def test_padding_rows_point_at_the_reserved_tail_only(shared):
    fill = shared_fill(shared)
    bucket = MixedStepInputs(TOKENS, REQS, "cpu", fill=fill)
    qsl = torch.tensor([0, 1, 2, 70], dtype=torch.int32)
    bucket.stage(qsl, qsl, torch.tensor([4, 5, 6], dtype=torch.int32), torch.tensor([3, 0, 9], dtype=torch.int32))
    real = 1 + 1 + 2
    assert (bucket.chunk_indices[real:] == torch.tensor([tail_seq(fill), 0], dtype=torch.int32)).all()
    # the kernels' cu_seqlens is the first REQS + 1 entries; every sequence after the last row up
    # to the tail one and the entry after it (read by KDA's token-parallel kernel past the last
    # row) hold the total
    full = bucket.staged.fla.cu_seqlens
    assert full.shape[0] == tail_seq(fill) + 2 and set(full[3:].tolist()) == {70}
    assert bucket.cu_seqlens.data_ptr() == full.data_ptr()


def shapes(bucket) -> dict:
    """Every tensor a forward or a stage reads of a bucket, by name: its shape (host ints as is)."""
    out = {name: tuple(t.shape) for name, t in vars(bucket).items() if isinstance(t, torch.Tensor)}
    out.update(levels=bucket.levels, tot=bucket.conv.nums_dict[8]["tot"], conv=tuple(bucket.conv.batch_ptr.shape))
    return out


@pytest.mark.parametrize("kind", ["gdn", "mamba2", "mamba2_align"])
def test_a_shared_fill_gives_each_bucket_the_shapes_of_its_own(kind):
    """Buckets of every capture size on one fill (one layout: one kernel compiled) read tables of
    their own capacity: the shapes, grids and levels a bucket with its own fill has."""

    def make(tokens, reqs, fill):
        if kind == "gdn":
            return MixedStepInputs(tokens, reqs, "cpu", fill=fill)
        return mixed_step.Mamba2StepInputs(tokens, reqs, "cpu", chunk_size=16, checkpoints=kind == "mamba2_align",
                                           fill=fill)  # fmt: skip

    sizes = (2, 4, 8, 16, 24, 32, 48, 64, 96)
    fill = mixed_step.SharedFill(max(sizes), 32)
    built = {(n, r): make(n, r, fill) for n in sizes for r in (1, 8, min(n, 32)) if r <= n}
    assert len({id(b.builder) for b in built.values()}) == 1
    for (n, r), bucket in built.items():
        assert shapes(bucket) == shapes(make(n, r, None)), (n, r)
    assert make(2 * max(sizes), 8, fill).builder is not built[2, 1].builder  # over the fill: its own


@pytest.mark.parametrize(
    "qsl, states, computed, match",
    [
        ([0] + [1] * 9, 9, 9, "over this mixed-step bucket"),  # 9 requests in a bucket of 8
        ([0, 50, 97], 2, 2, "over this mixed-step bucket"),  # 97 tokens in a bucket of 96
        ([0, 5, 9], 3, 2, "state_indices"),
        ([0, 5, 9], 2, 1, "num_computed_tokens"),
        ([0, 9, 5], 2, 2, "query_start_loc"),  # decreasing: the builder's own check
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(qsl, states, computed, match):
    bucket = MixedStepInputs(TOKENS, REQS, "cpu")
    ok = torch.tensor([0, 3, 7], dtype=torch.int32)
    bucket.stage(ok, ok, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))
    before = [t.clone() for t in (bucket.cu_seqlens, bucket.chunk_indices, bucket.state_indices,
                                  bucket.has_initial_state, bucket.conv.batch_ptr)]  # fmt: skip
    staged = bucket.staged
    qsl = torch.tensor(qsl, dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match=match):
        bucket.stage(qsl, qsl, torch.ones(states, dtype=torch.int32), torch.ones(computed, dtype=torch.int32))
    after = (bucket.cu_seqlens, bucket.chunk_indices, bucket.state_indices, bucket.has_initial_state,
             bucket.conv.batch_ptr)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert bucket.staged is staged and staged.fla.is_live


def test_a_bucket_needs_a_staged_step_before_its_forward():
    bucket = MixedStepInputs(TOKENS, REQS, "cpu")
    with pytest.raises(ChunkMetaError, match="stage"), bucket.fla_routed(object()):
        pass
    with pytest.raises(ChunkMetaError, match="num_reqs"):
        MixedStepInputs(TOKENS, 0, "cpu")


class Recorder:
    """Fake vLLM ops: record every tensor argument's shape and dtype; the FLA router's
    ``active`` records the provider the KDA op would be answered from."""

    def __init__(self):
        self.calls = []
        self.providers = []

    def record(self, name, *args, **kwargs):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        shapes.update({i: (tuple(v.shape), v.dtype) for i, v in enumerate(args) if isinstance(v, torch.Tensor)})
        self.calls.append((name, shapes))

    @contextlib.contextmanager
    def active(self, provider):
        self.providers.append(provider)
        yield

    def conv(self, x, weight, bias, **kwargs):
        self.record("conv", x, weight, **kwargs)
        assert kwargs["metadata"].nums_dict[8]["tot"] == kwargs["metadata"].batch_ptr.shape[0]
        return x.clone()

    def gather(self, state, indices, has_initial_state):
        self.record("gather", state, indices, has_initial_state)
        return state[indices.long()] * has_initial_state.view(-1, 1, 1, 1)

    def kda(self, **kwargs):
        self.record("kda", **kwargs)
        provider = self.providers[-1]
        assert provider.cu_seqlens is kwargs["cu_seqlens"] and provider.check_live() is provider
        return torch.zeros_like(kwargs["v"]), torch.ones_like(kwargs["initial_state"])

    def prep(self, conv_output, a, b, num_k_heads, head_k_dim, head_v_dim, **kwargs):
        self.record("prep", conv_output, a, b)
        t = conv_output.shape[0]
        q = torch.zeros(t, num_k_heads, head_k_dim)
        return (
            q,
            q.clone(),
            torch.zeros(t, a.shape[1], head_v_dim),
            torch.zeros(t, a.shape[1]),
            torch.zeros(t, a.shape[1]),
        )

    def rule(self, **kwargs):
        self.record("rule", **kwargs)
        return torch.zeros_like(kwargs["v"]), torch.full_like(kwargs["initial_state"], 2.0)


@pytest.mark.parametrize("levels", [False, True])
def test_forwards_see_the_same_shapes_whatever_the_batch(levels):
    """Without levels every call has the bucket's shapes (what a capture without IF nodes
    freezes); with them, every call of a level has that level's, whatever the batch (each level
    is captured once, in its IF node)."""
    heads, dim = 2, 4
    bucket = MixedStepInputs(TOKENS, REQS, "cpu", levels=levels)
    assert len(bucket.levels) == (1 if not levels else REQS.bit_length())
    rec = Recorder()
    kda_ops = KdaOps(rec.conv, rec.gather, rec.kda, rec)
    gdn_ops = GdnOps(rec.conv, rec.prep, rec.rule)
    recurrent = torch.randn(100, heads, dim, dim)
    ssm = torch.randn(100, 2 * heads, dim, dim)
    seen = {}
    rng = np.random.default_rng(5)
    for _ in range(24):
        qsl, states, computed = random_step(rng)
        bucket.stage(qsl, qsl, states, computed)
        rows, chunks = bucket.levels[bucket.staged_level]
        assert qsl.shape[0] - 1 <= rows and (not levels or bucket.staged_level == 0 or rows < 2 * (qsl.shape[0] - 1))
        rec.calls.clear()
        mixed_step.kda_mixed_forward(
            kda_ops, bucket, mixed_qkv=torch.randn(TOKENS, 3 * heads * dim), g1=torch.randn(1, TOKENS, heads, dim),
            beta=torch.randn(1, TOKENS, heads), conv_weights=(torch.randn(heads * dim, 4),) * 3,
            conv_states=(torch.randn(100, heads * dim, 3),) * 3, recurrent_state=recurrent, A_log=torch.zeros(heads),
            dt_bias=torch.zeros(heads * dim), lower_bound=None, head_dim=dim,
        )  # fmt: skip
        # every row's final state written back, the padded rows' into the null block
        assert (recurrent[states.long()] == 1).all()
        out = mixed_step.gdn_mixed_forward(
            gdn_ops, bucket, mixed_qkv=torch.randn(TOKENS, 4 * heads * dim), a=torch.randn(TOKENS, 2 * heads),
            b=torch.randn(TOKENS, 2 * heads), conv_weight=torch.randn(4 * heads * dim, 4), conv_bias=None,
            activation="silu", conv_state=torch.randn(100, 4 * heads * dim, 3), ssm_state=ssm, A_log=torch.zeros(2),
            dt_bias=torch.zeros(2), num_k_heads=heads, head_k_dim=dim, head_v_dim=dim,
        )  # fmt: skip
        assert out.shape == (1, TOKENS, 2 * heads, dim) and (ssm[states.long()] == 2).all()
        # shapes and dtypes of every argument: the batch changes none within a level
        assert rec.calls == seen.setdefault(bucket.staged_level, list(rec.calls))
    assert len(seen) == len(bucket.levels) or len(seen) >= 3
    with pytest.raises(ChunkMetaError, match="pad to the bucket"):
        mixed_step.kda_mixed_forward(
            kda_ops, bucket, mixed_qkv=torch.randn(TOKENS - 1, 3 * heads * dim), g1=None, beta=None, conv_weights=(),
            conv_states=(), recurrent_state=recurrent, A_log=None, dt_bias=None, lower_bound=None, head_dim=dim,
        )  # fmt: skip


def test_gdn_initial_states_are_zeroed_as_vllm_zeroes_them():
    """``where()`` against vLLM's boolean-mask fill (qwen_gdn_linear_attn.py:1817), bit for bit."""
    bucket = MixedStepInputs(TOKENS, REQS, "cpu")
    qsl = torch.tensor([0, 4, 9, 9], dtype=torch.int32)
    bucket.stage(qsl, qsl, torch.tensor([3, 1, 2], dtype=torch.int32), torch.tensor([0, 7, 0], dtype=torch.int32))
    ssm = torch.randn(10, 2, 4, 4)
    seen = {}

    def rule(**kwargs):
        seen["initial"] = kwargs["initial_state"].clone()
        return torch.zeros_like(kwargs["v"]), kwargs["initial_state"]

    ops = GdnOps(Recorder().conv, Recorder().prep, rule)
    mixed_step.gdn_mixed_forward(
        ops, bucket, mixed_qkv=torch.randn(TOKENS, 32), a=torch.randn(TOKENS, 2), b=torch.randn(TOKENS, 2),
        conv_weight=torch.randn(32, 4), conv_bias=None, activation="silu", conv_state=torch.randn(10, 32, 3),
        ssm_state=ssm.clone(), A_log=torch.zeros(2), dt_bias=torch.zeros(2), num_k_heads=1, head_k_dim=4, head_v_dim=4,
    )  # fmt: skip
    rows = bucket.levels[bucket.staged_level][0]  # the staged level's rows: 3 real, 1 padded
    assert rows == 4
    want = ssm[bucket.state_indices[:rows].long()]
    want[~bucket.has_initial_state[:rows], ...] = 0
    assert torch.equal(seen["initial"], want) and not want[0].any() and torch.equal(want[1], ssm[1])


def test_a_group_view_shares_the_bucket_and_keeps_its_own_state_indices():
    """Model Runner V2's other KV-cache groups (``GroupInputs``): the staged step's tables are the
    bucket's own tensors; the state indices are the group's, at one fixed address, padded with
    the null block; bad input refused with nothing written."""
    bucket = MixedStepInputs(TOKENS, REQS, "cpu")
    qsl, states, computed = random_step(np.random.default_rng(5), reqs_max=3)
    bucket.stage(qsl, qsl, states, computed)
    view = mixed_step.GroupInputs(bucket)
    address = view.state_indices.data_ptr()
    for theirs in (torch.tensor([7, 8, 9], dtype=torch.int32), torch.arange(REQS, dtype=torch.int32) + 40):
        view.stage_state_indices(theirs)
        n = theirs.shape[0]
        assert view.state_indices.tolist() == theirs.tolist() + [mixed_step.NULL_BLOCK_ID] * (REQS - n)
        assert view.state_indices.data_ptr() == address
    assert view.cu_seqlens is bucket.cu_seqlens and view.conv is bucket.conv and view.staged is bucket.staged
    assert view.has_initial_state is bucket.has_initial_state
    assert bucket.state_indices.tolist()[: states.shape[0]] == states.tolist()  # the bucket's own, untouched
    before = view.state_indices.clone()
    for bad in (torch.zeros(REQS + 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(2, 2)):
        with pytest.raises(ChunkMetaError, match="state_indices"):
            view.stage_state_indices(bad)
    assert torch.equal(view.state_indices, before)


def mamba2_step(rng, reqs_max=REQS, tokens_max=TOKENS, checkpoints=False):
    """A vLLM-ordered Mamba2 batch: one-token decodes (a cached prefix) first, then prefills
    with or without a cached prefix; checkpoint offsets inside the prefill rows (align mode)."""
    n = int(rng.integers(1, reqs_max + 1))
    decodes = int(rng.integers(0, n + 1))
    budget = max(int(rng.integers(0, tokens_max - decodes + 1)), 0)
    lens = [1] * decodes + list(rng.multinomial(budget, [1 / (n - decodes)] * (n - decodes)) if n > decodes else [])
    qsl = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    computed = [int(rng.integers(1, 300)) for _ in range(decodes)]
    computed += [int(rng.integers(0, 2)) * int(rng.integers(0, 300)) for _ in range(n - decodes)]
    offsets = [0] * decodes + [int(rng.integers(0, ln)) if checkpoints and ln > 1 else 0 for ln in lens[decodes:]]
    states = torch.tensor(rng.choice(np.arange(1, 100), size=n, replace=False), dtype=torch.int32)
    return qsl, states, torch.tensor(computed, dtype=torch.int32), decodes, torch.tensor(offsets, dtype=torch.int32)


def stage_mamba2(bucket, qsl, states, computed, decodes, offsets, checkpoints):
    extra = {}
    if checkpoints:
        extra = dict(checkpoint_offsets=offsets, checkpoint_offsets_cpu=offsets, checkpoint_state_indices=states + 100)
    bucket.stage(qsl, qsl, states, computed, num_computed_tokens_cpu=computed, num_decodes=decodes, **extra)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("decodes_mode", ["ssu", "ssd"])
@pytest.mark.parametrize("checkpoints", [False, True])
def test_mamba2_staged_steps_match_the_reference_at_fixed_addresses(checkpoints, decodes_mode, shared):
    fill = shared_fill(shared)
    bucket = mixed_step.Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=16, checkpoints=checkpoints,
                                         decodes=decodes_mode, fill=fill)  # fmt: skip
    other = mixed_step.Mamba2StepInputs(TOKENS // 2, REQS // 2, "cpu", chunk_size=16, checkpoints=checkpoints,
                                        decodes=decodes_mode, fill=fill)  # fmt: skip
    assert (other.builder is bucket.builder) == shared
    tensors = [bucket.ssd_cu_chunk_seqlens, bucket.seq_idx, bucket.last_chunk_indices, bucket.cu_seqlens,
               bucket.state_indices, bucket.has_initial_state, bucket.decode_rows, bucket.ssd_cu_seqlens,
               bucket.ssd_state_indices, bucket.ssd_has_initial, bucket.ssd_checkpoint_offsets,
               bucket.level_taken, bucket.conv.batch_ptr]  # fmt: skip
    fixed = [(t.shape, t.data_ptr()) for t in tensors]
    rng = np.random.default_rng(11)
    for _ in range(60):
        qsl, states, computed, decodes, offsets = mamba2_step(rng, checkpoints=checkpoints)
        n = qsl.shape[0] - 1
        extra = {}
        if checkpoints:
            extra = dict(checkpoint_offsets=offsets, checkpoint_offsets_cpu=offsets)
            extra.update(checkpoint_state_indices=states + 100)
        small = mamba2_step(rng, REQS // 2, TOKENS // 2, checkpoints=checkpoints)
        stage_mamba2(other, *small, checkpoints)  # between this bucket's steps: same tables when shared
        bucket.stage(qsl, qsl, states, computed, num_computed_tokens_cpu=computed, num_decodes=decodes, **extra)
        assert [(t.shape, t.data_ptr()) for t in tensors] == fixed
        # the SSD rows: the prefill rows (every row when decodes run as SSD rows), then padding
        p = decodes if decodes_mode == "ssu" else 0
        rows, tail = n - p, REQS - (n - p)
        ref = reference.mamba2_chunk_metadata(
            qsl.tolist(), computed[p:].tolist(), 16, p, rows, offsets[p:].tolist() if checkpoints else None
        )
        k, pad = ref.num_chunks, bucket.seq_idx.shape[0] - ref.num_chunks
        ahead = int(qsl[p])  # the SSD gets the whole step's tokens: its chunks start past the decodes'
        assert bucket.ssd_cu_chunk_seqlens.tolist() == [c + ahead for c in ref.cu_chunk_seqlens] + [int(qsl[-1])] * pad
        assert bucket.seq_idx.tolist() == ref.seq_idx + [0] * pad  # empty padding chunks, a row every level has
        assert bucket.last_chunk_indices.tolist() == ref.last_chunk_indices + [k - 1] * tail
        assert bucket.ssd_cu_seqlens.tolist() == qsl[p:].tolist() + [int(qsl[-1])] * tail
        assert bucket.ssd_state_indices.tolist() == states[p:].tolist() + [mixed_step.NULL_BLOCK_ID] * tail
        assert bucket.ssd_has_initial.tolist() == (computed[p:] > 0).tolist() + [False] * tail
        if checkpoints:
            marks = ref.checkpoint_chunk_idx or [0] * rows  # None where no row has one: zeros in the bucket
            assert bucket.checkpoint_chunk_idx.tolist() == marks + [0] * tail
            assert bucket.ssd_checkpoint_offsets.tolist() == offsets[p:].tolist() + [0] * tail
            assert bucket.ssd_checkpoint_state_indices.tolist() == (states + 100)[p:].tolist() + [0] * tail
        else:
            assert bucket.checkpoint_chunk_idx is None
        # the level: the smallest whose rows hold the SSD rows of tokens (the trailing rows of none
        # left out), none without any
        held = int(torch.searchsorted(qsl, qsl[-1:])) - p
        taken = [r >= held and (j == 0 or bucket.levels[j - 1][0] < held) for j, (r, _) in
                 enumerate(bucket.levels)] if held > 0 else [False] * len(bucket.levels)  # fmt: skip
        assert bucket.level_taken.tolist() == taken
        assert bucket.cu_seqlens.tolist() == qsl.tolist() + [int(qsl[-1])] * (REQS - n)
        assert bucket.decode_rows.tolist() == [True] * decodes + [False] * (REQS - decodes)
        assert bucket.state_indices.tolist() == states.tolist() + [mixed_step.NULL_BLOCK_ID] * (REQS - n)
        assert bucket.has_initial_state.tolist() == (computed > 0).tolist() + [False] * (REQS - n)


def test_mamba2_align_mode_bucket_of_one_token():
    """vLLM's smallest FULL key (1 token, 1 request) has a bucket in align mode too."""
    bucket = mixed_step.Mamba2StepInputs(1, 1, "cpu", chunk_size=16, checkpoints=True)
    one = torch.tensor([0, 1], dtype=torch.int32)
    row = torch.ones(1, dtype=torch.int32)
    none = row * 0
    bucket.stage(one, one, row * 7, row * 40, num_computed_tokens_cpu=row * 40, num_decodes=1,
                 checkpoint_offsets=none, checkpoint_offsets_cpu=none, checkpoint_state_indices=none)  # fmt: skip
    assert bucket.decode_rows.tolist() == [True] and bucket.state_indices.tolist() == [7]


def test_mamba2_bad_input_is_refused_and_nothing_is_written():
    bucket = mixed_step.Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=16)
    qsl, states, computed, decodes, _ = mamba2_step(np.random.default_rng(2))
    bucket.stage(qsl, qsl, states, computed, num_computed_tokens_cpu=computed, num_decodes=decodes)
    before = [t.clone() for t in (bucket.cu_seqlens, bucket.decode_rows, bucket.seq_idx, bucket.state_indices)]
    n = qsl.shape[0] - 1
    for num_decodes in (n + 1, -1, True):
        with pytest.raises(ChunkMetaError, match="num_decodes"):
            bucket.stage(qsl, qsl, states, computed, num_computed_tokens_cpu=computed, num_decodes=num_decodes)
    with pytest.raises(ChunkMetaError):
        bucket.stage(qsl, qsl, states, computed, num_computed_tokens_cpu=computed[:-1], num_decodes=0)
    after = [bucket.cu_seqlens, bucket.decode_rows, bucket.seq_idx, bucket.state_indices]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

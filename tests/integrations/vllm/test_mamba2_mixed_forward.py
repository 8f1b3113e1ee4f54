"""``mamba2_mixed_forward`` without vLLM (`make test`): its routing of rows, states and outputs.

The ops here are plain torch versions of vLLM's kernels' contracts (the conv per row, the SSD per
chunk from the bucket's tables, the SSU per row, the checkpoint store), all on one per-token
recurrence, so that a bucketed mixed step and vLLM's eager split (decodes through the conv update
and the SSU, prefills through the conv and the SSD, mamba_mixer2.py:803-1106) give the same bits
exactly when the forward hands every row to the right state, chunk and output. vLLM's own kernels
against its eager path: the exact bench (GPU)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.vllm import mixed_step
from chunkmeta.integrations.vllm.mixed_step import Mamba2Ops, Mamba2StepInputs, mamba2_mixed_forward

TOKENS, REQS, CHUNK = 96, 8, 16
HEADS, HEAD_DIM, GROUPS, STATE = 4, 4, 2, 4
WIDTH = 4  # the conv kernel: a conv state of WIDTH - 1 inputs
DIM = HEADS * HEAD_DIM + 2 * GROUPS * STATE
BLOCKS = 300  # cache lines: the null block 0, the rows' 1..99, checkpoint blocks 100..299
PAD_SLOT_ID = -1


def conv_row(window, xs, weight, bias):
    """One row's causal conv and SiLU from its ``WIDTH - 1`` previous inputs (in float32); the
    output in the input's dtype, the new window in the state's."""
    full = torch.cat([window.float(), xs.float()], dim=-1)
    out = F.silu(F.conv1d(full[None], weight.float()[:, None], None if bias is None else bias.float(), groups=DIM)[0])
    return out.to(xs.dtype), full[:, -(WIDTH - 1) :].to(window.dtype)


def ssm_token(h, x, dt, B, C, A, D, dt_bias):
    """One token of Mamba2's recurrence (in float32): the state ``[H, P, N]`` and the output ``[H, P]``."""
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    d = F.softplus(dt + dt_bias)
    Bh, Ch = (t.repeat_interleave(HEADS // GROUPS, 0) for t in (B, C))
    h = h * torch.exp(d * A)[:, None, None] + (d[:, None] * x)[:, :, None] * Bh[:, None, :]
    return h, (h * Ch[:, None, :]).sum(-1) + D[:, None] * x


def plain_conv(x, weight, bias, *, activation, conv_states, has_initial_state, cache_indices, metadata,
               query_start_loc):  # fmt: skip
    assert activation == "silu" and metadata is not None
    out = torch.full_like(x, float("nan"))  # a row's output that no program writes stays NaN
    for row in range(query_start_loc.shape[0] - 1):
        bos, eos, slot = int(query_start_loc[row]), int(query_start_loc[row + 1]), int(cache_indices[row])
        if bos == eos or slot in (PAD_SLOT_ID, mixed_step.NULL_BLOCK_ID):
            continue
        window = conv_states[slot] if has_initial_state[row] else torch.zeros(DIM, WIDTH - 1)
        out[:, bos:eos], conv_states[slot] = conv_row(window, x[:, bos:eos], weight, bias)
    return out


def plain_ssd(x, dt, A, B, C, *, chunk_size, D, z, dt_bias, seq_idx, cu_seqlens, cu_chunk_seqlens,
              last_chunk_indices, initial_states, return_intermediate_states, dt_softplus, dt_limit, out,
              state_dtype, final_states_out=None, final_state_indices=None):  # fmt: skip
    """vLLM's SSD contract, chunk by chunk from the tables: a chunk whose ``seq_idx`` differs from
    the previous one's starts from ``initial_states[seq_idx]`` (zeros without them); a sequence's
    final state is its last chunk's (its initial state when it has no chunk)."""
    assert z is None and dt_softplus and dt_limit == (0.0, float("inf")) and chunk_size == CHUNK
    if initial_states is None:
        initial_states = torch.zeros(cu_seqlens.shape[0] - 1, HEADS, HEAD_DIM, STATE)
    states = torch.zeros(seq_idx.shape[0], HEADS, HEAD_DIM, STATE)
    h = None
    for c in range(seq_idx.shape[0]):
        if c == 0 or seq_idx[c] != seq_idx[c - 1]:
            h = initial_states[int(seq_idx[c])].float()
        for t in range(int(cu_chunk_seqlens[c]), int(cu_chunk_seqlens[c + 1])):
            h, out[t] = ssm_token(h, x[t], dt[t], B[t], C[t], A, D, dt_bias)
        states[c] = h
    states = states.to(state_dtype)
    if return_intermediate_states:
        return states
    for b in range(last_chunk_indices.shape[0]):
        first = int(last_chunk_indices[b - 1]) + 1 if b else 0
        last = int(last_chunk_indices[b])
        final = states[last] if first <= last else initial_states[b]
        final_states_out[int(final_state_indices[b])] = final
    return None


def plain_ssu(state, x, dt, A, B, C, D, dt_bias, *, dt_softplus, state_batch_indices, dst_state_batch_indices,
              out):  # fmt: skip
    """vLLM's SSU contract: a row on the null block loads and stores no state, but writes an output."""
    assert dt_softplus and torch.equal(state_batch_indices, dst_state_batch_indices)
    for row in range(x.shape[0]):
        slot = int(state_batch_indices[row, 0])
        h = state[slot].float() if slot != mixed_step.NULL_BLOCK_ID else torch.zeros(HEADS, HEAD_DIM, STATE)
        h, out[row] = ssm_token(h, x[row], dt[row, :, 0], B[row], C[row], A[:, 0, 0], D[:, 0], dt_bias[:, 0])
        if slot != mixed_step.NULL_BLOCK_ID:
            state[slot] = h


def plain_store_checkpoint(checkpoint, chunk_idx, x, conv_state, chunk_states, ssm_state, query_start_loc, *,
                           state_len):  # fmt: skip
    for row in range(chunk_idx.shape[0]):
        offset, dst = int(checkpoint.checkpoint_offsets[row]), int(checkpoint.state_indices[row])
        if offset > 0:
            end = int(query_start_loc[row]) + offset
            conv_state[dst] = x[:, end - state_len : end]
            ssm_state[dst] = chunk_states[int(chunk_idx[row])]


OPS = Mamba2Ops(plain_conv, plain_ssd, plain_ssu, plain_store_checkpoint)


def eager_step(weights, batch, hidden_states_B_C, dt, conv_state, ssm_state):
    """vLLM's eager split of the same step, request by request: decodes are a conv update and one
    SSU token from their state; a prefill runs from its state (or zeros) and writes its final
    state, and its checkpoint block at its offset (align mode)."""
    qsl, slots, computed, decodes, offsets, checkpoint_slots = batch
    out = torch.full((TOKENS, HEADS * HEAD_DIM), float("nan"))
    for row in range(qsl.shape[0] - 1):
        bos, eos, slot = int(qsl[row]), int(qsl[row + 1]), int(slots[row])
        if bos == eos:  # a padding row, on the null block
            continue
        h = ssm_state[slot].float() if computed[row] > 0 else torch.zeros(HEADS, HEAD_DIM, STATE)
        xs = hidden_states_B_C[bos:eos].T
        window = conv_state[slot] if computed[row] > 0 else torch.zeros(DIM, WIDTH - 1)
        conv, conv_state[slot] = conv_row(window, xs, weights["conv_weight"], weights["conv_bias"])
        hidden, B, C = conv.T.split([HEADS * HEAD_DIM, GROUPS * STATE, GROUPS * STATE], dim=-1)
        for t in range(eos - bos):
            h, y = ssm_token(h, hidden[t].view(HEADS, HEAD_DIM), dt[bos + t], B[t].view(GROUPS, STATE),
                             C[t].view(GROUPS, STATE), weights["A"], weights["D"], weights["dt_bias"])  # fmt: skip
            out[bos + t] = y.flatten()
            if row >= decodes and t + 1 == int(offsets[row]):
                ssm_state[int(checkpoint_slots[row])] = h
                conv_state[int(checkpoint_slots[row])] = xs[:, t + 1 - (WIDTH - 1) : t + 1]
        ssm_state[slot] = h
    return out


def random_batch(rng, checkpoints):
    """A vLLM-ordered batch: one-token decodes first, then prefills of at least one token with or
    without a cached prefix, then (sometimes) padding rows of no token on the null block, as
    vLLM's FULL padding gives them; checkpoint offsets past the conv window inside some prefill
    rows."""
    n = int(rng.integers(1, REQS + 1))
    pad = int(rng.integers(0, n)) if rng.random() < 0.5 else 0
    decodes = int(rng.integers(0, n - pad + 1))
    prefills = n - pad - decodes
    budget = int(rng.integers(prefills, TOKENS - decodes + 1))
    extra = rng.multinomial(budget - prefills, [1 / prefills] * prefills) if prefills else []
    lens = [1] * decodes + [1 + int(k) for k in extra] + [0] * pad
    computed = [int(rng.integers(1, 300)) for _ in range(decodes)]
    computed += [int(rng.integers(0, 2)) * int(rng.integers(0, 300)) for _ in range(prefills)] + [0] * pad
    offsets = [0] * decodes
    offsets += [int(rng.integers(WIDTH - 1, ln)) if checkpoints and ln > WIDTH and rng.random() < 0.7 else 0
                for ln in lens[decodes:]]  # fmt: skip
    slots = list(rng.choice(np.arange(1, 100), size=n - pad, replace=False)) + [mixed_step.NULL_BLOCK_ID] * pad
    checkpoint_slots = rng.choice(np.arange(100, BLOCKS), size=n, replace=False)
    as_int = lambda v: torch.tensor(np.asarray(v, dtype=np.int64), dtype=torch.int32)  # noqa: E731
    return (as_int([0, *np.cumsum(lens)]), as_int(slots), as_int(computed), decodes, as_int(offsets),
            as_int(checkpoint_slots))  # fmt: skip


def layer(gen):
    return dict(
        conv_weight=torch.randn(DIM, WIDTH, generator=gen) * 0.5,
        conv_bias=torch.randn(DIM, generator=gen) * 0.1,
        A=-torch.rand(HEADS, generator=gen) - 0.1,
        D=torch.randn(HEADS, generator=gen),
        dt_bias=torch.randn(HEADS, generator=gen) * 0.1,
    )


def stage_args(batch, checkpoints: bool) -> tuple[tuple, dict]:
    """``Mamba2StepInputs.stage``'s arguments for a ``random_batch``."""
    qsl, slots, computed, num_decodes, offsets, checkpoint_slots = batch
    extra = {}
    if checkpoints:
        extra = dict(
            checkpoint_offsets=offsets, checkpoint_offsets_cpu=offsets, checkpoint_state_indices=checkpoint_slots
        )
    return (qsl, qsl, slots, computed), dict(num_computed_tokens_cpu=computed, num_decodes=num_decodes, **extra)


def check_step(bucket, weights, batch, gen) -> None:
    """The staged step through ``mamba2_mixed_forward`` against vLLM's eager split on random
    inputs (padded tokens too: garbage): its real output rows, and every cache line but the null
    block (the real rows' and checkpoints' as vLLM's, others untouched). Output starts NaN: a
    chunk the SSD skips would leave it so."""
    hidden_states_B_C = torch.randn(TOKENS, DIM, generator=gen)
    dt = torch.randn(TOKENS, HEADS, generator=gen)
    conv_state = torch.randn(BLOCKS, DIM, WIDTH - 1, generator=gen)
    ssm_state = torch.randn(BLOCKS, HEADS, HEAD_DIM, STATE, generator=gen)
    want_conv, want_ssm = conv_state.clone(), ssm_state.clone()
    want = eager_step(weights, batch, hidden_states_B_C, dt, want_conv, want_ssm)
    output = torch.full((TOKENS, HEADS * HEAD_DIM), float("nan"))
    mamba2_mixed_forward(
        OPS, bucket, hidden_states_B_C=hidden_states_B_C, dt=dt, output=output, activation="silu",
        conv_state=conv_state, ssm_state=ssm_state, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=GROUPS,
        state_len=WIDTH - 1, **weights,
    )  # fmt: skip
    real = int(batch[0][-1])
    assert torch.equal(output[:real], want[:real])
    assert torch.equal(conv_state[1:], want_conv[1:])
    assert torch.equal(ssm_state[1:], want_ssm[1:])


@pytest.mark.parametrize("decodes", ["ssu", "ssd"])
@pytest.mark.parametrize("checkpoints", [False, True])
def test_mixed_step_routes_every_row_as_vllms_eager_split(decodes, checkpoints):
    gen, rng = torch.Generator().manual_seed(5), np.random.default_rng(7)
    weights = layer(gen)
    bucket = Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK, checkpoints=checkpoints, decodes=decodes)
    assert [r for r, _ in bucket.levels] == [1, 2, 4, 8]  # the SSD runs on sliced rows and tables
    levels_run = set()
    for _ in range(25):
        batch = qsl, _, _, num_decodes, _, _ = random_batch(rng, checkpoints)
        args, kwargs = stage_args(batch, checkpoints)
        bucket.stage(*args, **kwargs)
        check_step(bucket, weights, batch, gen)
        level = bucket.staged_level
        levels_run.add(level)
        # the SSD rows before the trailing rows of no token (vLLM's padding): the levels leave those out
        with_tokens = int(torch.searchsorted(qsl, qsl[-1:]))
        ssd_rows = with_tokens - (num_decodes if decodes == "ssu" else 0)
        assert bucket.level_taken.tolist() == [k == level for k in range(len(bucket.levels))]
        if ssd_rows:
            # the staged level holds every SSD row and chunk (a smaller one would leave NaN above)
            rows, chunks = bucket.levels[level]
            assert ssd_rows <= rows and int(bucket.last_chunk_indices[ssd_rows - 1]) < chunks
            assert level == 0 or bucket.levels[level - 1][0] < ssd_rows
        else:
            assert level is None
    assert len(levels_run) >= 2


@pytest.mark.parametrize("checkpoints", [False, True])
@pytest.mark.parametrize("levels", [False, True])
def test_a_bucket_of_few_ssd_rows_serves_steps_within_them_and_refuses_the_others(checkpoints, levels):
    gen, rng = torch.Generator().manual_seed(11), np.random.default_rng(13)
    weights = layer(gen)
    ssd_rows, segments = 2, 2 if checkpoints else 1
    bucket = Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK, checkpoints=checkpoints, levels=levels,
                              ssd_rows=ssd_rows)  # fmt: skip
    # its SSD's rows and chunks stop at the tables' bound for ssd_rows rows: no padding chunk past it
    top = [1, 2] if levels else [2]
    assert bucket.levels == tuple((r, TOKENS // CHUNK + 2 * segments * r + 1) for r in top)
    served = refused = 0
    for _ in range(40):
        batch = qsl, _, _, num_decodes, _, _ = random_batch(rng, checkpoints)
        args, kwargs = stage_args(batch, checkpoints)
        if int(torch.searchsorted(qsl, qsl[-1:])) - num_decodes > ssd_rows:  # rows of tokens past the decodes
            before = [t.clone() for t in (bucket.cu_seqlens, bucket.ssd_cu_seqlens, bucket.state_indices)]
            with pytest.raises(ChunkMetaError, match=f"over this bucket's {ssd_rows}"):
                bucket.stage(*args, **kwargs)
            after = (bucket.cu_seqlens, bucket.ssd_cu_seqlens, bucket.state_indices)
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing written
            refused += 1
            continue
        bucket.stage(*args, **kwargs)
        check_step(bucket, weights, batch, gen)
        served += 1
    assert served >= 10 and refused >= 5
    with pytest.raises(ChunkMetaError, match="ssd_rows"):
        Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK, ssd_rows=REQS + 1)
    with pytest.raises(ChunkMetaError, match="every row is an SSD row"):
        Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK, decodes="ssd", ssd_rows=2)


def test_mamba2_levels_are_rows_in_powers_of_two_with_their_ssd_chunk_bound():
    capacity = TOKENS // CHUNK + 2 * REQS + 1  # the tables' bound (chunkmeta.tables._ssd_rows)
    bucket = Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK)
    assert bucket.seq_idx.shape[0] == capacity
    assert bucket.levels == tuple((r, TOKENS // CHUNK + 2 * r + 1) for r in (1, 2, 4, 8))
    six = Mamba2StepInputs(TOKENS, 6, "cpu", chunk_size=CHUNK, checkpoints=True)  # two segments a row
    assert six.levels == tuple((r, TOKENS // CHUNK + 4 * r + 1) for r in (1, 2, 4, 6))
    one = Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK, levels=False)
    assert one.levels == ((REQS, capacity),) and one.level_taken.tolist() == [True]


def test_bad_input_is_refused_before_anything_runs():
    bucket = Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK)
    calls = []
    ops = Mamba2Ops(*(lambda *a, **k: calls.append(a) for _ in range(4)))
    ok = dict(hidden_states_B_C=torch.zeros(TOKENS, DIM), dt=torch.zeros(TOKENS, HEADS),
              output=torch.zeros(TOKENS, HEADS * HEAD_DIM), conv_weight=None, conv_bias=None, activation="silu",
              conv_state=None, ssm_state=None, A=None, D=None, dt_bias=None, num_heads=HEADS, head_dim=HEAD_DIM,
              n_groups=GROUPS, state_len=WIDTH - 1)  # fmt: skip
    for name in ("hidden_states_B_C", "dt", "output"):
        short = dict(ok, **{name: ok[name][:-1]})
        with pytest.raises(ChunkMetaError, match="pad"):
            mamba2_mixed_forward(ops, bucket, **short)
    with pytest.raises(ChunkMetaError, match="decodes"):
        Mamba2StepInputs(TOKENS, REQS, "cpu", chunk_size=CHUNK, decodes="fla")
    assert calls == []

"""The host plan's three paths (compiled helper, Python loop, numpy) agree with each other and
with the reference on every input, valid or not: same sizes, or the same ChunkMetaError."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkmeta import ChunkMetaError, jit, native, plan, reference
from strategies import host_offsets

CAP = plan.capacity_for(4096, 1 << 20, 64)


def outcome(host, first_seq, num_seqs, address):
    try:
        step = plan.plan_step(host, first_seq, num_seqs, 64, CAP, address)
        return step._replace(segment=step.segment.tolist())
    except ChunkMetaError as exc:
        return str(exc)


@settings(max_examples=400, deadline=None)
@given(host=host_offsets(), data=st.data())
def test_paths_agree(host, data):
    first_seq = data.draw(st.integers(0, host.shape[0] - 1))
    num_seqs = data.draw(st.one_of(st.none(), st.integers(0, host.shape[0] - 1 - first_seq)))
    results = [outcome(host, first_seq, num_seqs, None)]  # Python loop or numpy, by size
    small = plan._SMALL_BATCH
    try:
        plan._SMALL_BATCH = -1  # every size takes the compiled helper, then numpy
        results.append(outcome(host, first_seq, num_seqs, plan.host_address(host)))
        results.append(outcome(host, first_seq, num_seqs, None))
    finally:
        plan._SMALL_BATCH = small
    assert results[0] == results[1] == results[2]
    if not isinstance(results[0], str):
        ref = reference.chunk_metadata(host.tolist(), 64, first_seq, num_seqs)
        assert (results[0].num_tokens, results[0].num_chunks, results[0].max_seqlen) == (
            ref.num_tokens,
            ref.num_chunks,
            ref.max_seqlen,
        )


def test_compiled_helper_is_built_here():
    """Where there is a C compiler and Python's headers (CI and dev machines: Triton needs a
    compiler too), the helper must compile and load."""
    reason = "CHUNKMETA_NATIVE=0" if not jit.enabled(native.SWITCH) else jit.missing_c_toolchain()
    if reason:
        pytest.skip(reason)
    assert native.module() is not None


def test_non_contiguous_host_arrays_use_numpy():
    host = np.arange(0, 40, 2, dtype=np.int32)[::2]
    assert plan.host_address(host) is None
    step = plan.plan_step(host, 0, None, 64, CAP, None)
    assert step.num_tokens == 36


def test_native_off_switch(monkeypatch):
    """CHUNKMETA_NATIVE=0: no helper, and the plan takes numpy for a batch the helper would take."""
    monkeypatch.setenv("CHUNKMETA_NATIVE", "0")
    monkeypatch.setattr(native, "_module", native._NOT_LOADED)
    assert native.module() is None
    host = np.arange(0, 4000, 40, dtype=np.int64)  # more sequences than plan._SMALL_BATCH
    step = plan.plan_step(host, 0, None, 64, CAP, plan.host_address(host))
    assert (step.num_seqs, step.num_tokens, step.num_chunks, step.max_seqlen) == (99, 3960, 99, 40)

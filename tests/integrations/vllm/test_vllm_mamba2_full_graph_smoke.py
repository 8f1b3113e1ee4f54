"""``bench/vllm_mamba2_exact.py`` on CPU (`make test-vllm`): vLLM 0.33.0's own
``MambaMixer2.conv_ssm_forward`` on the stock builder's metadata against the patched method on a
chunkmeta Mamba2 builder's bucket, batch by batch, with vLLM's real builders, forward context and
layer code and plain torch versions of the five kernels the layer calls (vLLM's CPU kernels need
compiled ops this install lacks; Triton's SSU does not run under the interpreter). It checks
the plumbing between them: every row's state, chunk and output where vLLM's path puts it. The
kernels themselves: the script on a GPU."""

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

import test_mamba2_mixed_forward as plain
from chunkmeta.integrations import vllm as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import vllm_mamba2_exact as exact


def conv_update(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens=None,
                query_start_loc=None, max_query_len=1):  # fmt: skip
    """vLLM's decode conv (one token per row, state in place) on ``plain.conv_row``."""
    assert activation == "silu" and num_accepted_tokens is None and query_start_loc is None
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        slot = int(conv_state_indices[row, 0])
        y, conv_state[slot] = plain.conv_row(conv_state[slot], x[row][:, None], weight, bias)
        out[row] = y[:, 0]
    return out


SSU_ROWS = []  # the row count of every SSU call (the bucket's: REQS; vLLM's: its decode rows)


def ssu(state, x, dt, A, B, C, D, dt_bias, *, dt_softplus, state_batch_indices, dst_state_batch_indices, out,
        num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False):  # fmt: skip
    assert num_accepted_tokens is None and cu_seqlens is None
    SSU_ROWS.append(x.shape[0])
    plain.plain_ssu(state, x, dt, A, B, C, D, dt_bias, dt_softplus=dt_softplus,
                    state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices,
                    out=out)  # fmt: skip


@pytest.fixture
def plain_kernels(monkeypatch):
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    for name, fn in (
        ("causal_conv1d_fn", plain.plain_conv),
        ("causal_conv1d_update", conv_update),
        ("mamba_chunk_scan_combined_varlen", plain.plain_ssd),
        ("selective_state_update", ssu),
        ("store_prefill_checkpoint", plain.plain_store_checkpoint),
    ):
        monkeypatch.setattr(mamba_mixer2, name, fn)
    monkeypatch.setattr(ssu_dispatch, "initialize_mamba_ssu_backend", lambda *args, **kwargs: None)
    sizes = dict(HEADS=plain.HEADS, HEAD_DIM=plain.HEAD_DIM, GROUPS=plain.GROUPS, STATE=plain.STATE,
                 CONV=plain.WIDTH, CHUNK=plain.CHUNK)  # fmt: skip
    for name, value in sizes.items():
        monkeypatch.setattr(exact, name, value)
    adapter.uninstall()
    yield
    adapter.uninstall()


@pytest.mark.parametrize(
    ("decodes", "ssd_rows"), [("ssu", 0), ("ssd", 0), ("ssu", 2)]
)  # (the plain kernels share one recurrence: both decode modes exact)
def test_vllms_eager_mixer_and_the_bucketed_one_agree_batch_by_batch(
    plain_kernels, monkeypatch, tmp_path, decodes, ssd_rows
):
    # the script sets these in os.environ: set here first, so that the test's end restores them
    for name in ("CHUNKMETA_VLLM_FULL_GRAPH", "CHUNKMETA_VLLM_MAMBA2_DECODES", "CHUNKMETA_VLLM_MAMBA2_SSD_ROWS",
                 "CHUNKMETA_VLLM_LEVELS"):  # fmt: skip
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1 (this machine's), MRV2 where the script asks
    args = types.SimpleNamespace(
        batches=24, tokens=plain.TOKENS, requests=plain.REQS, seed=3, out=str(tmp_path), decodes=decodes, timed=0,
        ssd_rows=ssd_rows,
    )  # fmt: skip
    SSU_ROWS.clear()
    result = exact.run(args, torch.device("cpu"))
    # the bucket's SSU over all its rows ran for "ssu" only (vLLM's batches have fewer decodes)
    assert (plain.REQS in SSU_ROWS) == (decodes == "ssu")
    assert result["decode_rows"] > 10 and result["mismatches"] == []
    assert result["identical_batches"] == dict.fromkeys(
        ("output_prefill", "output_decode", "conv_states", "ssm_states"), 24
    )
    assert (
        result["staged_steps"] == 24 + 2 and result["mixed_fallbacks"] == {}
    )  # capture + warm-up build, then one per batch
    assert result["ssd_rows"] == (ssd_rows or plain.REQS)
    assert [r for r, _ in result["levels"]] == [ssd_rows or plain.REQS]

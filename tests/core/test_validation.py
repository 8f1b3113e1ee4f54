"""Bad input raises ChunkMetaError naming the argument, the value and the fix; nothing changes."""

import numpy as np
import pytest
import torch

from checks import as_lists, assert_exact, tensors_for
from chunkmeta import ChunkMetadataBuilder, ChunkMetaError, build_chunk_metadata
from chunkmeta.workloads import from_lengths

GOOD = from_lengths([1, 1, 100, 64, 0, 130], first_seq=2)


def _builder(backend="torch", **kw):
    kw.setdefault("chunk_size", 64)
    return ChunkMetadataBuilder(8, 1000, device="cpu", backend=backend, **kw)


def _bad_cases():
    q = torch.tensor(GOOD.query_start_loc, dtype=torch.int32)
    big = torch.tensor([0, 2**31 - 10, 2**31 + 100], dtype=torch.int64)
    return [
        # (name, query_start_loc, query_start_loc_cpu, kwargs, message fragments)
        (
            "decreasing",
            q,
            torch.tensor([0, 1, 2, 90, 80, 80, 210], dtype=torch.int32),
            {},
            ["decreasing at index 4", "90 -> 80", "non-decreasing"],
        ),
        (
            "negative start",
            q,
            torch.tensor([-5, 1, 2, 90, 95, 95, 210], dtype=torch.int32),
            {"first_seq": 0},
            ["query_start_loc_cpu[0]=-5", ">= 0"],
        ),
        ("float host", q, q.float(), {}, ["dtype torch.float32", "int32 or torch.int64"]),
        ("bool host", q, q.bool(), {}, ["dtype torch.bool"]),
        ("int16 host", q, q.to(torch.int16), {}, ["dtype torch.int16"]),
        ("0-d host", q, torch.tensor(5, dtype=torch.int32), {}, ["shape ()", "1-D"]),
        ("2-d host", q, q.view(1, -1), {}, ["shape (1, 7)", "1-D"]),
        ("list host", q, GOOD.query_start_loc, {}, ["is a list"]),
        ("float device", q.float(), q, {}, ["query_start_loc has dtype torch.float32"]),
        ("2-d device", q.view(1, -1), q, {}, ["query_start_loc has shape (1, 7)"]),
        ("non-contiguous device", torch.stack([q, q], 1)[:, 0], q, {}, ["stride 2", "contiguous"]),
        ("length mismatch", q[:-1], q, {}, ["6 entries", "7"]),
        ("first_seq out of range", q, q, {"first_seq": 9}, ["first_seq=9", "[0, 6]"]),
        ("first_seq negative", q, q, {"first_seq": -1}, ["first_seq=-1"]),
        ("first_seq float", q, q, {"first_seq": 1.0}, ["first_seq=1.0", "must be an int"]),
        ("first_seq bool", q, q, {"first_seq": True}, ["first_seq=True"]),
        ("num_seqs too many", q, q, {"first_seq": 2, "num_seqs": 5}, ["num_seqs=5", "[0, 4]"]),
        ("num_seqs negative", q, q, {"num_seqs": -1}, ["num_seqs=-1"]),
        ("over 2^31 tokens", big, big, {}, ["int32"]),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_and_changes_nothing(backend, case):
    name, qsl, qsl_cpu, kwargs, fragments = case
    builder = _builder(backend)
    qsl_good, qsl_cpu_good = tensors_for(GOOD)
    live = builder.build(qsl_good, qsl_cpu_good, first_seq=GOOD.first_seq)
    before = as_lists(live), live.cu_seqlens_cpu.tolist(), builder.builds
    with pytest.raises(ChunkMetaError) as info:
        builder.build(qsl, qsl_cpu, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert (as_lists(live), live.cu_seqlens_cpu.tolist(), builder.builds) == before
    assert live.is_live
    # the builder still works
    assert_exact(builder.build(qsl_good, qsl_cpu_good, first_seq=GOOD.first_seq), GOOD, 64)


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_one_shot_bad_input(case):
    name, qsl, qsl_cpu, kwargs, fragments = case
    with pytest.raises(ChunkMetaError) as info:
        build_chunk_metadata(qsl, qsl_cpu, **kwargs)
    # the one-shot has no capacity, so capacity messages differ; the argument is always named
    assert any(word in str(info.value) for word in ("query_start_loc", "first_seq", "num_seqs", "tokens"))


def test_capacity_limits():
    builder = _builder()  # 8 sequences, 1000 tokens, 16 + 8 rows at C=64
    too_many_seqs = from_lengths([1] * 9)
    too_many_tokens = from_lengths([600, 401])
    with pytest.raises(ChunkMetaError, match="num_seqs=9 exceeds the builder's capacity of 8"):
        builder.build(*tensors_for(too_many_seqs))
    with pytest.raises(ChunkMetaError, match="1001 tokens, over the builder's capacity of 1000"):
        builder.build(*tensors_for(too_many_tokens))
    # capacity exactly: fine
    exact = from_lengths([1] * 7 + [993])
    assert_exact(builder.build(*tensors_for(exact)), exact, 64)


def test_chunk_row_capacity_is_enforced():
    # 2 sequences, 100 tokens at C=16: rows = cdiv(100, 16) + 2 = 9; 1+1+... lengths that need 10
    builder = ChunkMetadataBuilder(2, 100, chunk_size=16, device="cpu")
    assert builder.capacity.rows == 9
    ok = from_lengths([17, 83])  # 2 + 6 = 8 rows
    assert_exact(builder.build(*tensors_for(ok)), ok, 16)


@pytest.mark.parametrize("chunk_size", [0, 8, 48, 100, 8192, -64, 64.0, True])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ChunkMetaError, match="chunk_size="):
        ChunkMetadataBuilder(4, 100, chunk_size=chunk_size, device="cpu")
    qsl, qsl_cpu = tensors_for(GOOD)
    with pytest.raises(ChunkMetaError, match="chunk_size="):
        build_chunk_metadata(qsl, qsl_cpu, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"max_num_seqs": 0, "max_num_tokens": 10}, "max_num_seqs=0"),
        ({"max_num_seqs": 2**17, "max_num_tokens": 10}, "max_num_seqs=131072"),
        ({"max_num_seqs": 4, "max_num_tokens": 0}, "max_num_tokens=0"),
        ({"max_num_seqs": 4, "max_num_tokens": 2**31}, "max_num_tokens=2147483648"),
        ({"max_num_seqs": 4, "max_num_tokens": 10, "ring_depth": 0}, "ring_depth=0"),
        ({"max_num_seqs": 4, "max_num_tokens": 10, "backend": "cuda"}, "backend='cuda'"),
        ({"max_num_seqs": 4, "max_num_tokens": 10, "device": "nope"}, "device='nope'"),
    ],
)
def test_bad_builder_arguments(kwargs, fragment):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ChunkMetaError, match=fragment.replace("(", r"\(")):
        ChunkMetadataBuilder(**kwargs)


def test_numpy_int_slice_arguments_are_accepted():
    builder = _builder()
    md = builder.build(*tensors_for(GOOD), first_seq=np.int64(2), num_seqs=np.int32(4))
    assert_exact(md, GOOD, 64)


def test_chunk_metadata_error_is_a_value_error():
    assert issubclass(ChunkMetaError, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch's answer")
def test_a_cuda_builder_on_cpu_only_torch_is_a_clear_error():
    with pytest.raises(ChunkMetaError, match="sees no CUDA device; use device='cpu'"):
        ChunkMetadataBuilder(4, 64, device="cuda")
    with pytest.raises(ChunkMetaError, match="sees no CUDA device"):
        ChunkMetadataBuilder(4, 64, device="cuda:1")


def _without_interpreter(code: str) -> str:
    """stdout of ``code`` run in a fresh process without TRITON_INTERPRET (Triton fixes
    interpreted or compiled when it is first imported, so this cannot run in the test's own)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    out = _without_interpreter(
        "from chunkmeta import ChunkMetadataBuilder, ChunkMetaError\n"
        "try:\n    ChunkMetadataBuilder(4, 64, device='cpu', backend='triton')\n"
        "except ChunkMetaError as e:\n    print('ChunkMetaError:', e)\n"
    )
    assert "ChunkMetaError: backend='triton' on CPU tensors runs only under Triton's interpreter" in out, out


def test_graph_mode_on_cpu_without_the_interpreter_is_a_clear_error():
    out = _without_interpreter(
        "import torch\nfrom chunkmeta import ChunkMetadataBuilder, ChunkMetaError, GraphBuild\n"
        "b = ChunkMetadataBuilder(4, 64, device='cpu')\n"
        "try:\n    GraphBuild(b, torch.zeros(5, dtype=torch.int32))\n"
        "except ChunkMetaError as e:\n    print('ChunkMetaError:', e)\n"
    )
    assert "ChunkMetaError: GraphBuild needs the Triton kernel: backend='triton' on CPU tensors runs only" in out, out

"""``python -m chunkmeta --trace FILE``: every malformed trace is a ChunkMetaError naming file:line and
the key, and the command answers it with ``error: ...`` on stderr and exit code 2, never a traceback;
well-formed traces load as written; every table set replays through the service and is checked per
table (a wrong table or a wrong reference exits 1); the demo's output starts with its own table."""

import json
import os
import subprocess
import sys

import pytest
import torch

from chunkmeta import ChunkMetaError, reference
from chunkmeta.__main__ import main
from chunkmeta.replay import DEFAULT_TRACE, load_trace, replay, write_trace
from chunkmeta.workloads import Batch

GOOD = '{"query_start_loc": [0, 1, 2, 302], "first_seq": 2, "num_seqs": 1}'


def step(**record) -> str:
    return json.dumps(record)


# (name, trace text, line of the error, what the message must say)
MALFORMED = [
    ("empty", "", None, "the trace is empty"),
    ("blank lines only", "\n  \n\n", None, "the trace is empty"),
    ("not json", '{"query_start_loc": [0, 1]', 1, "not JSON"),
    ("not an object", "[0, 1, 2]", 1, "an array, not a JSON object"),
    ("a bare number", "7", 1, "not a JSON object"),
    ("missing query_start_loc", step(first_seq=0), 1, "'query_start_loc' is missing"),
    ("query_start_loc a string", step(query_start_loc="0,1"), 1, "'query_start_loc' is \"0,1\": must be a non-empty"),
    ("query_start_loc an int", step(query_start_loc=5), 1, "'query_start_loc' is 5: must be a non-empty"),
    ("query_start_loc an object", step(query_start_loc={"0": 1}), 1, "'query_start_loc' is {\"0\": 1}"),
    ("query_start_loc empty", step(query_start_loc=[]), 1, "'query_start_loc' is \\[\\]: must be a non-empty"),
    ("entry a string", step(query_start_loc=[0, "5"]), 1, "'query_start_loc\\[1\\]' is \"5\" \\(a string\\)"),
    ("entry a float", step(query_start_loc=[0, 5.0]), 1, "'query_start_loc\\[1\\]' is 5.0 \\(a float\\)"),
    ("entry a bool", step(query_start_loc=[0, True]), 1, "'query_start_loc\\[1\\]' is true \\(a boolean\\)"),
    ("entry null", step(query_start_loc=[None, 5]), 1, "'query_start_loc\\[0\\]' is null"),
    ("entry an array", step(query_start_loc=[0, [5]]), 1, "'query_start_loc\\[1\\]' is \\[5\\] \\(an array\\)"),
    ("entry NaN", '{"query_start_loc": [0, NaN]}', 1, "'query_start_loc\\[1\\]' is NaN \\(a float\\)"),
    ("decreasing", step(query_start_loc=[0, 5, 3]), 1, "'query_start_loc' decreases at index 2 \\(5 -> 3\\)"),
    ("negative", step(query_start_loc=[-1, 4]), 1, "'query_start_loc\\[0\\]' is -1: must be in 0..2147483647"),
    ("past int32", step(query_start_loc=[0, 2**31]), 1, "'query_start_loc\\[1\\]' is 2147483648: must be in 0.."),
    (
        "first_seq past the batch",
        step(query_start_loc=[0, 1, 2], first_seq=3),
        1,
        "'first_seq' is 3: must be in 0..2 \\(query_start_loc has 2 requests\\)",
    ),
    ("first_seq negative", step(query_start_loc=[0, 1, 2], first_seq=-1), 1, "'first_seq' is -1: must be in 0..2"),
    ("first_seq a string", step(query_start_loc=[0, 1], first_seq="0"), 1, "'first_seq' is \"0\" \\(a string\\)"),
    ("first_seq a float", step(query_start_loc=[0, 1], first_seq=0.0), 1, "'first_seq' is 0.0 \\(a float\\)"),
    ("first_seq a bool", step(query_start_loc=[0, 1], first_seq=False), 1, "'first_seq' is false \\(a boolean\\)"),
    (
        "num_seqs past the batch",
        step(query_start_loc=[0, 1, 2], first_seq=1, num_seqs=2),
        1,
        "'num_seqs' is 2: must be in 0..1 \\(query_start_loc has 2 requests, the slice starts at first_seq=1\\)",
    ),
    ("num_seqs negative", step(query_start_loc=[0, 1, 2], num_seqs=-1), 1, "'num_seqs' is -1: must be in 0..2"),
    ("num_seqs a string", step(query_start_loc=[0, 1], num_seqs="1"), 1, "'num_seqs' is \"1\" \\(a string\\)"),
    ("num_seqs a float", step(query_start_loc=[0, 1], num_seqs=1.0), 1, "'num_seqs' is 1.0 \\(a float\\)"),
    ("num_seqs a bool", step(query_start_loc=[0, 1], num_seqs=True), 1, "'num_seqs' is true \\(a boolean\\)"),
    ("num_seqs null", step(query_start_loc=[0, 1], num_seqs=None), 1, "'num_seqs' is null"),
    ("unknown key", step(query_start_loc=[0, 1], num_tokens=1), 1, "unknown key 'num_tokens'"),
    ("misspelt key", step(query_start_loc=[0, 1], firstseq=0), 1, "unknown key 'firstseq'"),
    ("repeated key", '{"query_start_loc": [0, 1], "first_seq": 0, "first_seq": 1}', 1, "key 'first_seq' appears twice"),
    (
        "num_computed_tokens an int",
        step(query_start_loc=[0, 1, 5], num_computed_tokens=3),
        1,
        "'num_computed_tokens' is 3: must be an array of 2 ints, one per request",
    ),
    (
        "num_computed_tokens null",
        step(query_start_loc=[0, 1], num_computed_tokens=None),
        1,
        "'num_computed_tokens' is null",
    ),
    (
        "num_computed_tokens too short",
        step(query_start_loc=[0, 1, 5], num_computed_tokens=[0]),
        1,
        "'num_computed_tokens' is \\[0\\]: must be an array of 2 ints",
    ),
    (
        "num_computed_tokens too long",
        step(query_start_loc=[0, 1], num_computed_tokens=[0, 0]),
        1,
        "must be an array of 1 ints",
    ),
    (
        "num_computed_tokens entry a float",
        step(query_start_loc=[0, 1, 5], num_computed_tokens=[0, 1.0]),
        1,
        "'num_computed_tokens\\[1\\]' is 1.0 \\(a float\\)",
    ),
    (
        "num_computed_tokens entry a string",
        step(query_start_loc=[0, 1], num_computed_tokens=["7"]),
        1,
        "'num_computed_tokens\\[0\\]' is \"7\" \\(a string\\)",
    ),
    (
        "num_computed_tokens entry a bool",
        step(query_start_loc=[0, 1], num_computed_tokens=[True]),
        1,
        "'num_computed_tokens\\[0\\]' is true \\(a boolean\\)",
    ),
    (
        "num_computed_tokens negative",
        step(query_start_loc=[0, 1, 5], num_computed_tokens=[0, -4]),
        1,
        "'num_computed_tokens\\[1\\]' is -4: must be in 0..2147483643 \\(request 1 brings 4 new tokens",
    ),
    (
        "num_computed_tokens past int32 positions",
        step(query_start_loc=[0, 1, 5], num_computed_tokens=[0, 2**31 - 4]),
        1,
        "'num_computed_tokens\\[1\\]' is 2147483644: must be in 0..2147483643 .*positions are int32",
    ),
    (
        "error after good lines and a blank one",
        f"{GOOD}\n{GOOD}\n\n{step(query_start_loc=[0, 1], first_seq=5)}\n",
        4,
        "'first_seq' is 5",
    ),
]


def where(path, line):
    return f"{path}:{line}: " if line is not None else f"{path}: "


@pytest.mark.parametrize("text, line, message", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_load_trace_names_file_line_and_key(tmp_path, text, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(ChunkMetaError) as raised:
        load_trace(path)
    prefix = where(path, line)
    assert str(raised.value).startswith(prefix), str(raised.value)
    assert raised.match(message)


@pytest.mark.parametrize("text, line, message", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_cli_answers_a_malformed_trace_with_exit_2(tmp_path, capsys, text, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    assert main(["--trace", str(path), "--no-fla", "--repeats", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: {where(path, line)}"), err
    assert len(err.splitlines()) == 1  # the message alone, no traceback


def test_unreadable_traces(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"query_start_loc": [0, 1]}\n\xff\xfe\n')
    for path, message in [
        (missing, "cannot read the trace \\(No such file or directory\\)"),
        (tmp_path, "cannot read the trace"),
        (binary, "not UTF-8 text"),
    ]:
        with pytest.raises(ChunkMetaError, match=message):
            load_trace(path)
        assert main(["--trace", str(path), "--no-fla"]) == 2
        assert capsys.readouterr().err.startswith(f"error: {path}: ")


def test_bad_repeats_is_a_usage_error(capsys):
    for value in ["0", "-3", "x"]:
        with pytest.raises(SystemExit) as exited:
            main(["--repeats", value, "--no-fla"])
        assert exited.value.code == 2
        assert "error: argument --repeats" in capsys.readouterr().err


def test_well_formed_traces_load_as_written(tmp_path):
    path = tmp_path / "trace.jsonl"
    # CRLF line ends, blank lines, keys in any order, defaults for first_seq and num_seqs, a slice
    # that starts at the end of the batch, zero-length requests, a batch that does not start at 0
    path.write_text(
        "\r\n".join(
            [
                GOOD,
                "",
                step(query_start_loc=[0, 64, 64, 100], num_computed_tokens=[0, 7, 2**31 - 37]),
                step(num_seqs=0, first_seq=3, query_start_loc=[0, 1, 2, 3]),
                step(query_start_loc=[7, 9], first_seq=1),
                step(query_start_loc=[0]),
            ]
        )
        + "\r\n"
    )
    assert load_trace(path) == [
        Batch([0, 1, 2, 302], 2, 1),
        Batch([0, 64, 64, 100], 0, 3, [0, 7, 2**31 - 37]),
        Batch([0, 1, 2, 3], 3, 0),
        Batch([7, 9], 1, 0),
        Batch([0], 0, 0),
    ]


def test_write_trace_round_trips_the_default_trace(tmp_path):
    steps = load_trace()
    assert len(steps) == len(load_trace(DEFAULT_TRACE)) > 0
    path = tmp_path / "copy.jsonl"
    write_trace(path, steps)
    assert load_trace(path) == steps


def test_report_names_the_backend_auto_chose_and_points_to_the_gpu_figures(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n" + step(query_start_loc=[0, 100, 228]) + "\n")
    assert main(["--trace", str(path), "--no-fla", "--repeats", "1", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == "step N T fla fla_batch conv mamba2 mamba2_conv host_us b2b_us match".split()
    per_table = "(fla 0, fla_batch 0, conv 0, mamba2 0, mamba2_conv 0)"
    assert f"mismatches: 0 {per_table}  device: cpu  backend: torch (chosen by auto)" in "\n".join(lines)
    assert "bench/RESULTS.md" in lines[-1] and "docs/gpu.md" in lines[-1]


# --- the whole step: every table set through the service, checked per table -----------------

# cached prefixes: a partial first chunk (30 cached), a chunk-aligned one (512), a zero-length row
# after a prefix, a chunked prompt's continuation (a decode-first batch)
CACHED_TRACE = "\n".join(
    [
        step(query_start_loc=[0, 1, 2, 302, 302, 367], first_seq=2, num_computed_tokens=[9, 4, 30, 512, 0]),
        step(query_start_loc=[0, 1, 257, 258, 258], first_seq=1, num_computed_tokens=[300, 512, 4091, 0]),
        step(query_start_loc=[0, 100, 700], num_computed_tokens=[200, 1000]),
        step(query_start_loc=[0, 1, 2], first_seq=2),  # no prefill; num_computed_tokens absent
    ]
)


def cached_trace(tmp_path, text=CACHED_TRACE):
    path = tmp_path / "cached.jsonl"
    path.write_text(text + "\n")
    return str(path)


@pytest.mark.parametrize(
    "tables, names",
    [
        ("all", "fla fla_batch conv mamba2 mamba2_conv"),
        ("kda", "fla fla_batch conv"),
        ("mamba2", "mamba2 mamba2_conv"),
        ("fla", "fla"),
    ],
)
def test_every_table_set_replays_through_the_service(tmp_path, capsys, tables, names):
    argv = ["--trace", cached_trace(tmp_path), "--tables", tables, "--no-fla", "--repeats", "2", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["step", "N", "T", *names.split(), "host_us", "b2b_us", "match"]
    per_table = ", ".join(f"{name} 0" for name in names.split())
    assert f"steps: 4  mismatches: 0 ({per_table})" in out
    assert f"tables: {tables} = " in out and "through ChunkMetaService, strict" in out
    assert "service stats: 24 builds" in out  # (1 warm-up + 2 checked + 1 + 2 back to back) x 4 steps, via the hooks
    if "mamba2" in names:
        assert "num_computed_tokens: from the trace in 3 of 4 steps (0 for every request in the other 1)" in out
    else:
        assert "num_computed_tokens" not in out


def test_the_triton_kernel_replays_the_whole_step(tmp_path, capsys):
    argv = ["--trace", cached_trace(tmp_path), "--backend", "triton", "--no-fla", "--repeats", "1", "--device", "cpu"]
    assert main(argv) == 0
    assert "mismatches: 0 (" in capsys.readouterr().out


def test_num_computed_tokens_moves_the_mamba2_chunks_and_defaults_to_zero(tmp_path):
    # 100 new tokens after 200 cached: cut at position 256 (two chunks); with none cached, one
    steps = load_trace(cached_trace(tmp_path, step(query_start_loc=[0, 100], num_computed_tokens=[200])))
    run = replay(steps, tables="mamba2", repeats=1, compare_fla=False)
    assert run.steps[0].rows["mamba2"] == 2 and run.steps[0].matched
    steps = load_trace(cached_trace(tmp_path, step(query_start_loc=[0, 100])))
    assert steps[0].num_computed_tokens is None
    run = replay(steps, tables="mamba2", repeats=1, compare_fla=False)
    assert run.steps[0].rows["mamba2"] == 1 and run.steps[0].matched


def test_a_wrong_reference_exits_1_naming_the_table(tmp_path, capsys, monkeypatch):
    real = reference.mamba2_chunk_metadata

    def off_by_one(*args, **kwargs):
        ref = real(*args, **kwargs)
        if ref.num_chunks:
            return ref._replace(cu_chunk_seqlens=[0] + [v + 1 for v in ref.cu_chunk_seqlens[1:]])
        return ref

    monkeypatch.setattr(reference, "mamba2_chunk_metadata", off_by_one)
    assert main(["--trace", cached_trace(tmp_path), "--no-fla", "--repeats", "1", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    # steps 0-2 have SSD chunks; the others' tables all match
    assert "steps: 4  mismatches: 3 (fla 0, fla_batch 0, conv 0, mamba2 3, mamba2_conv 0)" in out
    assert out.count("MISMATCH:mamba2\n") == 3


def test_a_wrong_table_exits_1_naming_the_table(tmp_path, capsys, monkeypatch):
    from chunkmeta.service import ChunkMetaService

    real = ChunkMetaService.begin_step

    def corrupting(self, batch):
        step = real(self, batch)
        if step.conv.tot:  # an engine bug stand-in: one entry of the built conv1d table changes
            with torch.inference_mode():  # where engines run (outside it, the write would raise)
                step.conv.token_chunk_offset_ptr[step.conv.tot - 1] += 1
        return step

    monkeypatch.setattr(ChunkMetaService, "begin_step", corrupting)
    assert main(["--trace", cached_trace(tmp_path), "--tables", "kda", "--no-fla", "--repeats", "1"]) == 1
    out = capsys.readouterr().out
    assert "steps: 4  mismatches: 4 (fla 0, fla_batch 0, conv 4)" in out
    assert "MISMATCH:conv" in out


def test_the_default_trace_exercises_cached_prefixes():
    steps = load_trace()
    assert all(b.num_computed_tokens is not None for b in steps)
    rows = [
        (b.query_start_loc[i + 1] - b.query_start_loc[i], b.num_computed_tokens[i])
        for b in steps
        for i in range(b.first_seq, b.first_seq + b.num_seqs)
    ]
    assert any(n and c % 256 for n, c in rows)  # a partial first chunk
    assert any(n and c and c % 256 == 0 for n, c in rows)  # a chunk-aligned prefix
    assert any(n == 0 for n, _ in rows)  # zero-length rows
    assert len(steps) <= 60  # small: make demo replays it on two CPU cores


FLA_WARNING = "Triton is not supported on current platform"


@pytest.mark.skipif(torch.cuda.is_available(), reason="FLA warns on import only where Triton finds no GPU")
def test_demo_output_starts_with_its_table_not_a_third_party_warning(tmp_path):
    pytest.importorskip("fla")
    # as `make demo` runs: a fresh interpreter (FLA warns once, on its first import), no interpreter mode
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = subprocess.run(
        [sys.executable, "-c", "import fla.ops.utils.index"], env=env, capture_output=True, text=True, timeout=300
    )
    assert FLA_WARNING in probe.stderr, "FLA no longer warns on import: this test proves nothing, update it"
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n")
    demo = subprocess.run(
        [sys.executable, "-m", "chunkmeta", "--trace", str(path), "--repeats", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr
    assert demo.stderr == ""
    assert demo.stdout.splitlines()[0].split()[:4] == ["step", "N", "T", "fla"]
    assert "FLA prepare_chunk_indices" in demo.stdout  # the comparison ran: FLA was imported

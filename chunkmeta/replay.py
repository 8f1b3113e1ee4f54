"""The main job: replay a scheduler trace through a ChunkMetadataBuilder and check every step.

A trace is JSON Lines, one step per line::

    {"query_start_loc": [0, 1, 2, 302], "first_seq": 2, "num_seqs": 1}

``query_start_loc`` is the step's cumulative query lengths over every request (decodes first, as
vLLM orders them), ``first_seq`` where the prefill slice starts (vLLM: ``num_decodes``),
``num_seqs`` optional (default: the rest of the batch). Blank lines are skipped; anything else
that is not such a step (a missing or unknown key, a value that is not an int, offsets that
decrease, a slice outside the batch) is a ``ChunkMetaError`` naming ``file:line`` and the key.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from chunkmeta import reference
from chunkmeta.builder import ChunkMetadataBuilder
from chunkmeta.errors import ChunkMetaError
from chunkmeta.timing import device_us_per_call, host_us, median, percentile
from chunkmeta.workloads import Batch

DEFAULT_TRACE = Path(__file__).parent / "traces" / "default.jsonl"
_EXAMPLE = '{"query_start_loc": [0, 1, 2, 302], "first_seq": 2, "num_seqs": 1}'
_KEYS = ("query_start_loc", "first_seq", "num_seqs")
_INT32_MAX = 2**31 - 1
# what json.loads returns, by the JSON names a user wrote
_JSON_KINDS = {
    int: "an int",
    bool: "a boolean",
    float: "a float",
    str: "a string",
    type(None): "null",
    list: "an array",
    dict: "an object",
}


def load_trace(path: str | Path | None = None) -> list[Batch]:
    """The steps of a JSON Lines trace (default: the embedded one); see the module docstring."""
    path = Path(path) if path is not None else DEFAULT_TRACE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ChunkMetaError(f"{path}: cannot read the trace ({exc.strerror or exc}).") from None
    except UnicodeDecodeError as exc:
        raise ChunkMetaError(f"{path}: not UTF-8 text (byte {exc.start}); a trace is JSON Lines.") from None
    # split on newlines only: str.splitlines also splits on form feeds and such, and the line
    # numbers in the errors would then not be the ones an editor shows
    steps = [_step(f"{path}:{number}", line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not steps:
        raise ChunkMetaError(f"{path}: the trace is empty; write one step per line, e.g. {_EXAMPLE}")
    return steps


def _step(where: str, line: str) -> Batch:
    try:
        record = json.loads(line, object_pairs_hook=lambda pairs: _object(where, pairs))
    except json.JSONDecodeError as exc:
        raise ChunkMetaError(
            f"{where}: not JSON ({exc.msg}, column {exc.colno}); each line is a step like {_EXAMPLE}"
        ) from None
    if not isinstance(record, dict):
        raise ChunkMetaError(
            f"{where}: {_JSON_KINDS[type(record)]}, not a JSON object; each line is a step like {_EXAMPLE}"
        )
    unknown = [key for key in record if key not in _KEYS]
    if unknown:
        raise ChunkMetaError(f"{where}: unknown key {unknown[0]!r}; a step has only {', '.join(map(repr, _KEYS))}.")
    if "query_start_loc" not in record:
        raise ChunkMetaError(f"{where}: 'query_start_loc' is missing; each line is a step like {_EXAMPLE}")
    qsl = record["query_start_loc"]
    if not isinstance(qsl, list) or not qsl:
        raise ChunkMetaError(
            f"{where}: 'query_start_loc' is {json.dumps(qsl)}: must be a non-empty array of ints "
            "(the step's cumulative query lengths, e.g. [0, 1, 2, 302])."
        )
    for k, value in enumerate(qsl):
        _check_int(where, f"query_start_loc[{k}]", value, 0, _INT32_MAX, "(int32, as engines hand it over)")
        if k and value < qsl[k - 1]:
            raise ChunkMetaError(
                f"{where}: 'query_start_loc' decreases at index {k} ({qsl[k - 1]} -> {value}): "
                "offsets are cumulative lengths, never smaller than the one before."
            )
    requests = len(qsl) - 1
    first_seq = record.get("first_seq", 0)
    _check_int(where, "first_seq", first_seq, 0, requests, f"(query_start_loc has {requests} requests)")
    num_seqs = record.get("num_seqs", requests - first_seq)
    _check_int(
        where,
        "num_seqs",
        num_seqs,
        0,
        requests - first_seq,
        f"(query_start_loc has {requests} requests, the slice starts at first_seq={first_seq})",
    )
    return Batch(qsl, first_seq, num_seqs)


def _object(where: str, pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are unique: json.loads would silently keep the last of a repeated one."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ChunkMetaError(f"{where}: key {key!r} appears twice; give each key once.")
        seen.add(key)
    return dict(pairs)


def _check_int(where: str, key: str, value: object, low: int, high: int, why: str) -> None:
    # JSON's true and 1.0 are a bool and a float in Python, and int() would take both: type() is exact
    if type(value) is not int:
        raise ChunkMetaError(f"{where}: '{key}' is {json.dumps(value)} ({_JSON_KINDS[type(value)]}): must be an int.")
    if not low <= value <= high:
        raise ChunkMetaError(f"{where}: '{key}' is {value}: must be in {low}..{high} {why}.")


def write_trace(path: str | Path, steps: list[Batch]) -> None:
    lines = [
        json.dumps({"query_start_loc": b.query_start_loc, "first_seq": b.first_seq, "num_seqs": b.num_seqs})
        for b in steps
    ]
    Path(path).write_text("\n".join(lines) + "\n")


class StepResult(NamedTuple):
    num_seqs: int
    num_tokens: int
    num_chunks: int
    host_us: float  # median over repeats
    fla_host_us: float | None
    device_us: float | None
    matched: bool


class Replay(NamedTuple):
    steps: list[StepResult]
    backend: str  # the builder's: what backend="auto" chose, or the one asked for


def _matches(md, ref: reference.Reference) -> bool:
    """Values, dtypes and host ints against the reference (reads device memory: not timed)."""
    return (
        md.cu_seqlens.cpu().tolist() == ref.cu_seqlens
        and [tuple(r) for r in md.chunk_indices.cpu().tolist()] == ref.chunk_indices
        and md.chunk_offsets.cpu().tolist() == ref.chunk_offsets
        and md.cu_seqlens_cpu.tolist() == ref.cu_seqlens
        and (md.num_seqs, md.num_tokens, md.num_chunks, md.max_seqlen)
        == (ref.num_seqs, ref.num_tokens, ref.num_chunks, ref.max_seqlen)
        and (md.cu_seqlens.dtype, md.chunk_indices.dtype, md.chunk_offsets.dtype)
        == (torch.int32, torch.int32, torch.int64)
    )


def _fla_prepare():
    """FLA's own derivation (prepare_chunk_indices + prepare_chunk_offsets), or None."""
    try:
        with warnings.catch_warnings():
            # FLA warns on import wherever Triton finds no GPU (any CPU machine). Its prepare_*
            # helpers are torch code that runs anyway, so the warning says nothing about this run.
            warnings.filterwarnings("ignore", "Triton is not supported on current platform", UserWarning, r"fla\.")
            from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets
    except Exception:  # noqa: BLE001 - any failure to import means "not available"
        return None

    def run(cu_seqlens, chunk_size):
        prepare_chunk_indices(cu_seqlens, chunk_size)
        prepare_chunk_offsets(cu_seqlens, chunk_size)

    return run


def replay(
    steps: list[Batch],
    *,
    device: str = "cpu",
    backend: str = "auto",
    chunk_size: int = 64,
    repeats: int = 5,
    compare_fla: bool = True,
) -> Replay:
    """Build every step ``repeats`` times through one builder, check each result against the
    reference, and time it (and FLA's prepare_* on the same steps, when fla-core is installed)."""
    max_seqs = max(1, max(b.num_seqs for b in steps))
    max_tokens = max(1, max(b.num_tokens for b in steps))
    builder = ChunkMetadataBuilder(max_seqs, max_tokens, chunk_size=chunk_size, device=device, backend=backend)
    fla = _fla_prepare() if compare_fla else None
    results = []
    for batch in steps:
        ref = reference.chunk_metadata(batch.query_start_loc, chunk_size, batch.first_seq, batch.num_seqs)
        qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
        qsl = qsl_cpu.to(device)

        def build():
            return builder.build(qsl, qsl_cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs)

        matched = _matches(build(), ref)  # also the warm-up (the kernel compiles on first use)
        times = []
        for _ in range(repeats):
            box = []
            times.append(host_us(lambda: box.append(build())))
            matched = matched and _matches(box[0], ref)
        fla_us = None
        if fla is not None:
            cu = qsl[batch.first_seq : batch.first_seq + batch.num_seqs + 1] - qsl[batch.first_seq]
            # FLA caches its results by tensor identity: a fresh tensor per call defeats the cache.
            fresh = [cu.clone() for _ in range(repeats + 1)]
            fla(fresh.pop(), chunk_size)  # warm-up
            fla_us = median([host_us(lambda t=t: fla(t, chunk_size)) for t in fresh])
        device_us = device_us_per_call(build, calls=50) if builder.device.type == "cuda" else None
        results.append(
            StepResult(ref.num_seqs, ref.num_tokens, ref.num_chunks, median(times), fla_us, device_us, matched)
        )
    return Replay(results, builder.backend)


def report(run: Replay, *, device: str, backend: str, fla_skipped: bool = False) -> str:
    """The per-step table and the summary; ``backend`` is the one asked for (``auto`` is resolved
    by the builder, and the report says to what)."""
    results = run.steps
    has_fla = any(r.fla_host_us is not None for r in results)
    has_device = any(r.device_us is not None for r in results)
    header = f"{'step':>4} {'N':>5} {'T':>7} {'NT':>6} {'host_us':>8}"
    header += f" {'fla_us':>8}" if has_fla else ""
    header += f" {'dev_us':>7}" if has_device else ""
    lines = [header + "  match"]
    for k, r in enumerate(results):
        line = f"{k:>4} {r.num_seqs:>5} {r.num_tokens:>7} {r.num_chunks:>6} {r.host_us:>8.1f}"
        if has_fla:
            line += f" {r.fla_host_us:>8.1f}"
        if has_device:
            line += f" {r.device_us:>7.2f}"
        lines.append(line + ("  ok" if r.matched else "  MISMATCH"))
    host = [r.host_us for r in results]
    mismatches = sum(not r.matched for r in results)
    lines.append("")
    chosen = f"{run.backend} (chosen by auto)" if backend == "auto" else run.backend
    lines.append(f"steps: {len(results)}  mismatches: {mismatches}  device: {device}  backend: {chosen}")
    lines.append(f"chunkmeta host us per build: p50 {median(host):.1f}  p99 {percentile(host, 99):.1f}")
    if has_fla:
        fla = [r.fla_host_us for r in results]
        lines.append(
            f"FLA prepare_chunk_indices+prepare_chunk_offsets host us: p50 {median(fla):.1f}  "
            f"p99 {percentile(fla, 99):.1f}  (chunkmeta is {median(fla) / median(host):.1f}x faster at p50)"
        )
    elif fla_skipped:
        lines.append("FLA comparison: skipped (--no-fla)")
    else:
        lines.append("FLA comparison: fla-core not installed (pip install fla-core==0.6.0)")
    if has_device:
        dev = [r.device_us for r in results]
        lines.append(f"chunkmeta device us per build: p50 {median(dev):.2f}  p99 {percentile(dev, 99):.2f}")
    lines.append("GPU figures (H200): bench/RESULTS.md and docs/gpu.md in the chunkmeta source tree.")
    return "\n".join(lines)

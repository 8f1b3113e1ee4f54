"""The main job: replay a scheduler trace through a ChunkMetadataBuilder and check every step.

A trace is JSON Lines, one step per line::

    {"query_start_loc": [0, 1, 2, 302], "first_seq": 2, "num_seqs": 1}

``query_start_loc`` is the step's cumulative query lengths over every request (decodes first, as
vLLM orders them), ``first_seq`` where the prefill slice starts (vLLM: ``num_decodes``),
``num_seqs`` optional (default: the rest of the batch). Other keys are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from chunkmeta import reference
from chunkmeta.builder import ChunkMetadataBuilder
from chunkmeta.errors import ChunkMetaError
from chunkmeta.timing import device_us_per_call, host_us, median, percentile
from chunkmeta.workloads import Batch

DEFAULT_TRACE = Path(__file__).parent / "traces" / "default.jsonl"


def load_trace(path: str | Path | None = None) -> list[Batch]:
    path = Path(path) if path is not None else DEFAULT_TRACE
    steps = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            qsl = [int(v) for v in record["query_start_loc"]]
            first_seq = int(record.get("first_seq", 0))
            num_seqs = record.get("num_seqs")
            num_seqs = len(qsl) - 1 - first_seq if num_seqs is None else int(num_seqs)
        except (ValueError, KeyError, TypeError) as exc:
            raise ChunkMetaError(
                f"{path}:{number}: not a trace step ({exc}); each line must be a JSON object with "
                "'query_start_loc' (list of ints) and 'first_seq' (int), optional 'num_seqs'."
            ) from None
        steps.append(Batch(qsl, first_seq, num_seqs))
    return steps


def write_trace(path: str | Path, steps: list[Batch]) -> None:
    lines = [json.dumps({"query_start_loc": b.query_start_loc, "first_seq": b.first_seq, "num_seqs": b.num_seqs})
             for b in steps]
    Path(path).write_text("\n".join(lines) + "\n")


class StepResult(NamedTuple):
    num_seqs: int
    num_tokens: int
    num_chunks: int
    host_us: float  # median over repeats
    fla_host_us: float | None
    device_us: float | None
    matched: bool


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
        from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets
    except Exception:  # noqa: BLE001 - any failure to import means "not available"
        return None

    def run(cu_seqlens, chunk_size):
        prepare_chunk_indices(cu_seqlens, chunk_size)
        prepare_chunk_offsets(cu_seqlens, chunk_size)

    return run


def replay(steps: list[Batch], *, device: str = "cpu", backend: str = "auto", chunk_size: int = 64,
           repeats: int = 5, compare_fla: bool = True) -> list[StepResult]:
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
            cu = qsl[batch.first_seq: batch.first_seq + batch.num_seqs + 1] - qsl[batch.first_seq]
            # FLA caches its results by tensor identity: a fresh tensor per call defeats the cache.
            fresh = [cu.clone() for _ in range(repeats + 1)]
            fla(fresh.pop(), chunk_size)  # warm-up
            fla_us = median([host_us(lambda t=t: fla(t, chunk_size)) for t in fresh])
        device_us = device_us_per_call(build, calls=50) if builder.device.type == "cuda" else None
        results.append(StepResult(ref.num_seqs, ref.num_tokens, ref.num_chunks, median(times), fla_us,
                                  device_us, matched))
    return results


def report(results: list[StepResult], *, device: str, backend: str, fla_skipped: bool = False) -> str:
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
    lines.append(f"steps: {len(results)}  mismatches: {mismatches}  device: {device}  backend: {backend}")
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
    return "\n".join(lines)

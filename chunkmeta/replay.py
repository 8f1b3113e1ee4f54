"""The main job: replay a scheduler trace through the scheduler hooks and check every table.

Each step goes through a ``ChunkMetaService`` as an engine calls it (``begin_step`` with the
step's ``StepBatch``, every table read, ``end_step``; strict mode), and every table it returns is
checked against ``chunkmeta.reference``. The table sets (``TABLE_SETS``, ``--tables``): ``kda``,
what a Kimi-Linear / Qwen3-Next step reads (FLA's tables of the prefill rows and of the whole
batch, vLLM's causal-conv1d tables of the batch); ``mamba2``, a vLLM Mamba2 step's (the SSD chunk
tables and the conv1d tables of the prefill rows); ``all``, both in one build; ``fla``, the FLA
prefill table alone, through the FLA-only service.

A trace is JSON Lines, one step per line::

    {"query_start_loc": [0, 1, 2, 302], "first_seq": 2, "num_seqs": 1, "num_computed_tokens": [7, 30, 512]}

``query_start_loc`` is the step's cumulative query lengths over every request (decodes first, as
vLLM orders them), ``first_seq`` where the prefill slice starts (vLLM: ``num_decodes``),
``num_seqs`` optional (default: the rest of the batch), ``num_computed_tokens`` optional: one int
per request, the tokens already in its cache (vLLM: ``seq_lens - query_lens``), where the Mamba2
tables cut their chunks; where absent the replay uses 0 for every request (no cached prefix).
Blank lines are skipped; anything else that is not such a step (a missing or unknown key, a value
that is not an int, offsets that decrease, a slice outside the batch, a ``num_computed_tokens``
of another length or past int32 positions) is a ``ChunkMetaError`` naming ``file:line`` and the key.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from chunkmeta import reference
from chunkmeta import tables as _tables
from chunkmeta.batch import StepBatch
from chunkmeta.errors import ChunkMetaError
from chunkmeta.service import ChunkMetaService
from chunkmeta.timing import device_us_per_call, host_us, median, percentile
from chunkmeta.workloads import Batch

DEFAULT_TRACE = Path(__file__).parent / "traces" / "default.jsonl"
_EXAMPLE = '{"query_start_loc": [0, 1, 2, 302], "first_seq": 2, "num_seqs": 1}'
_KEYS = ("query_start_loc", "first_seq", "num_seqs", "num_computed_tokens")
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
    computed = record.get("num_computed_tokens")
    if computed is not None or "num_computed_tokens" in record:
        _check_computed(where, computed, qsl)
    return Batch(qsl, first_seq, num_seqs, computed)


def _check_computed(where: str, computed: object, qsl: list[int]) -> None:
    requests = len(qsl) - 1
    if not isinstance(computed, list) or len(computed) != requests:
        raise ChunkMetaError(
            f"{where}: 'num_computed_tokens' is {json.dumps(computed)}: must be an array of {requests} ints, one "
            "per request of query_start_loc (the tokens already in its cache), or left out (0 for every request)."
        )
    for k, value in enumerate(computed):
        new = qsl[k + 1] - qsl[k]
        _check_int(
            where,
            f"num_computed_tokens[{k}]",
            value,
            0,
            _INT32_MAX - new,
            f"(request {k} brings {new} new tokens after them; positions are int32)",
        )


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
    lines = []
    for b in steps:
        record = {"query_start_loc": b.query_start_loc, "first_seq": b.first_seq, "num_seqs": b.num_seqs}
        if b.num_computed_tokens is not None:
            record["num_computed_tokens"] = b.num_computed_tokens
        lines.append(json.dumps(record))
    Path(path).write_text("\n".join(lines) + "\n")


# --- what is replayed, and how each table is checked -----------------------------------------


def kda_tables(chunk_size: int = 64) -> dict:
    """A Kimi-Linear / Qwen3-Next step: FLA's tables of the prefill rows and of the whole batch
    (``non_spec_query_start_loc`` layers), vLLM's causal-conv1d tables of the batch."""
    return {
        "fla": _tables.Fla(chunk_size),
        "fla_batch": _tables.Fla(chunk_size, rows="batch"),
        "conv": _tables.Conv(),
    }


def mamba2_tables(chunk_size: int = 256) -> dict:
    """A vLLM Mamba2 step: the SSD chunks (absolute positions) and the conv1d tables of the prefill rows."""
    return {"mamba2": _tables.Mamba2(chunk_size=chunk_size), "mamba2_conv": _tables.Conv(rows="prefill")}


TABLE_SETS = ("all", "kda", "mamba2", "fla")


def table_set(name: str, chunk_size: int = 64, mamba_chunk_size: int = 256) -> dict | None:
    """The specs ``--tables name`` replays; None for ``fla`` (the FLA-only service)."""
    if name == "fla":
        return None
    if name == "kda":
        return kda_tables(chunk_size)
    if name == "mamba2":
        return mamba2_tables(mamba_chunk_size)
    if name == "all":
        return {**kda_tables(chunk_size), **mamba2_tables(mamba_chunk_size)}
    raise ChunkMetaError(f"tables={name!r}: must be one of {TABLE_SETS}.")


def _lists(*tensors) -> list:
    return [t.cpu().tolist() for t in tensors]  # reads device memory: never timed


def _fla_matches(md, ref: reference.Reference, offsets_dtype=torch.int64) -> bool:
    """Values, dtypes and host ints against the reference."""
    cu, indices, offsets = _lists(md.cu_seqlens, md.chunk_indices, md.chunk_offsets)
    return (
        cu == ref.cu_seqlens
        and [tuple(r) for r in indices] == ref.chunk_indices
        and offsets == ref.chunk_offsets
        and md.cu_seqlens_cpu.tolist() == ref.cu_seqlens
        and (md.num_seqs, md.num_tokens, md.num_chunks, md.max_seqlen)
        == (ref.num_seqs, ref.num_tokens, ref.num_chunks, ref.max_seqlen)
        and (md.cu_seqlens.dtype, md.chunk_indices.dtype, md.chunk_offsets.dtype)
        == (torch.int32, torch.int32, offsets_dtype)
    )


def _conv_matches(blocks, ref: reference.ConvReference, num_rows: int) -> bool:
    batch_ptr, offsets = _lists(blocks.batch_ptr, blocks.token_chunk_offset_ptr)
    return (
        (blocks.tot, blocks.num_rows) == (ref.tot, num_rows)
        and blocks.block_table is None
        and batch_ptr == ref.batch_ptr
        and offsets == ref.token_chunk_offset_ptr
        and blocks.batch_ptr.dtype == blocks.token_chunk_offset_ptr.dtype == torch.int32
    )


def _mamba2_matches(chunks, ref: reference.Mamba2Reference, num_prefills: int) -> bool:
    cu, seq_idx, last = _lists(chunks.cu_chunk_seqlens, chunks.seq_idx, chunks.last_chunk_indices)
    return (
        (cu, seq_idx, last) == (ref.cu_chunk_seqlens, ref.seq_idx, ref.last_chunk_indices)
        and chunks.checkpoint_chunk_idx is None
        and (chunks.num_chunks, chunks.num_prefills) == (ref.num_chunks, num_prefills)
        and bool(chunks.prep_initial_states) == ref.prep_initial_states
        and chunks.cu_chunk_seqlens.dtype == chunks.seq_idx.dtype == chunks.last_chunk_indices.dtype == torch.int32
    )


class Expected(NamedTuple):
    """One step's reference tables, by table name, and how to compare a built table with each."""

    checks: dict  # name -> (built table -> bool)
    rows: dict  # name -> the table's rows in the reference (the report's columns)


def expected(specs: dict | None, batch: Batch, chunk_size: int) -> Expected:
    """The reference of every table of ``specs`` (None: the FLA-only service's one table) for a step."""
    qsl, first, n = batch.query_start_loc, batch.first_seq, batch.num_seqs
    requests = len(qsl) - 1
    computed = batch.num_computed_tokens or [0] * requests
    specs = {"fla": _tables.Fla(chunk_size)} if specs is None else specs
    checks, rows = {}, {}
    for name, spec in specs.items():
        rows_first, rows_n = (first, n) if spec.rows == "prefill" else (0, requests)
        if isinstance(spec, _tables.Fla):
            ref = reference.chunk_metadata(qsl, spec.chunk_size, rows_first, rows_n)
            checks[name] = lambda t, ref=ref, dtype=spec.offsets_dtype: _fla_matches(t, ref, dtype)
            rows[name] = ref.num_chunks
        elif isinstance(spec, _tables.Conv) and not spec.paired:
            ref = reference.causal_conv1d_metadata(qsl[rows_first : rows_first + rows_n + 1], spec.block_m)
            checks[name] = lambda t, ref=ref, rows_n=rows_n: _conv_matches(t, ref, rows_n)
            rows[name] = ref.tot
        elif isinstance(spec, _tables.Mamba2) and not spec.checkpoints:
            ref = reference.mamba2_chunk_metadata(qsl, computed[first : first + n], spec.chunk_size, first, n)
            checks[name] = lambda t, ref=ref: _mamba2_matches(t, ref, n)
            rows[name] = ref.num_chunks
        else:
            raise ChunkMetaError(f"the replay checks no {spec!r} table (tables {name!r}); see replay.TABLE_SETS.")
    return Expected(checks, rows)


# --- the replay ------------------------------------------------------------------------------


class StepResult(NamedTuple):
    num_seqs: int
    num_tokens: int
    rows: dict  # table name -> its rows (FLA: NT; conv1d: blocks; Mamba2: SSD chunks)
    host_us: float  # begin_step, median over repeats, each after the previous one's reference check
    back_to_back_us: float  # begin_step, median over as many calls back to back (end_step between)
    fla_host_us: float | None
    device_us: float | None
    mismatched: tuple[str, ...]  # the tables that differed from the reference in any repeat

    @property
    def matched(self) -> bool:
        return not self.mismatched


class Replay(NamedTuple):
    steps: list[StepResult]
    backend: str  # the builder's: what backend="auto" chose, or the one asked for
    tables: str  # the table set replayed
    names: tuple[str, ...]  # its tables
    kinds: frozenset[str]  # their spec classes' names
    stats: object  # the service's ServiceStats after the replay
    computed_steps: int  # steps whose num_computed_tokens came from the trace


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


def _step_batch(batch: Batch, device, needs_computed: bool) -> StepBatch:
    """The StepBatch an engine would hand over: device tensors and their host copies."""
    qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    rows = {}
    if needs_computed:
        computed = batch.num_computed_tokens or [0] * (len(batch.query_start_loc) - 1)
        computed_cpu = torch.tensor(computed, dtype=torch.int32)
        rows = dict(num_computed_tokens=computed_cpu.to(device), num_computed_tokens_cpu=computed_cpu)
    return StepBatch.decode_first(qsl_cpu.to(device), qsl_cpu, batch.first_seq, num_prefills=batch.num_seqs, **rows)


def replay(
    steps: list[Batch],
    *,
    device: str = "cpu",
    backend: str = "auto",
    tables: str = "all",
    chunk_size: int = 64,
    mamba_chunk_size: int = 256,
    repeats: int = 5,
    compare_fla: bool = True,
) -> Replay:
    """Run every step ``repeats`` times through one strict ``ChunkMetaService`` over the table set
    ``tables`` (``TABLE_SETS``), check every table of every repeat against the reference, and time
    ``begin_step`` (and FLA's prepare_* on the FLA prefill table, when fla-core is installed)."""
    specs = table_set(tables, chunk_size, mamba_chunk_size)
    max_seqs = max(1, max(len(b.query_start_loc) - 1 for b in steps))
    max_tokens = max(1, max(b.query_start_loc[-1] - b.query_start_loc[0] for b in steps))
    sizes = {"chunk_size": chunk_size} if specs is None else {"tables": specs}  # with tables= each spec has its own
    service = ChunkMetaService(max_seqs, max_tokens, device=device, backend=backend, strict=True, **sizes)
    needs_computed = specs is not None and service.builder.needs_computed
    fla = _fla_prepare() if compare_fla and (specs is None or "fla" in specs) else None
    results = []
    for batch in steps:
        want = expected(specs, batch, chunk_size)
        step_batch = _step_batch(batch, service.builder.device, needs_computed)
        qsl = step_batch.query_start_loc
        mismatched = set()
        times = []
        for k in range(repeats + 1):  # the first is also the warm-up (the kernel compiles on first use)
            start = time.perf_counter_ns()
            result = service.begin_step(step_batch)
            elapsed = (time.perf_counter_ns() - start) / 1e3
            try:
                built = {"fla": result} if specs is None else result  # the FLA-only service: its one table
                mismatched.update(name for name, matches in want.checks.items() if not matches(built[name]))
            finally:
                service.end_step()
            if k:
                times.append(elapsed)
        # the same build with nothing between calls: the caches hold the build's code and data
        # (how ../shared/ANCHORS.md times its anchors); the checked calls above run cold, after a
        # reference check, as a build runs between an engine's steps
        service.begin_step(step_batch)  # untimed: the first call after a check is a cold one
        service.end_step()
        back_to_back = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            service.begin_step(step_batch)
            back_to_back.append((time.perf_counter_ns() - start) / 1e3)
            service.end_step()
        fla_us = None
        if fla is not None:
            cu = qsl[batch.first_seq : batch.first_seq + batch.num_seqs + 1] - qsl[batch.first_seq]
            # FLA caches its results by tensor identity: a fresh tensor per call defeats the cache.
            fresh = [cu.clone() for _ in range(repeats + 1)]
            fla(fresh.pop(), chunk_size)  # warm-up
            fla_us = median([host_us(lambda t=t: fla(t, chunk_size)) for t in fresh])
        device_us = None
        if service.builder.device.type == "cuda":

            def step_hooks():
                service.begin_step(step_batch)
                service.end_step()

            device_us = device_us_per_call(step_hooks, calls=50)
        results.append(
            StepResult(
                batch.num_seqs,
                batch.num_tokens,
                want.rows,
                median(times),
                median(back_to_back),
                fla_us,
                device_us,
                tuple(name for name in want.rows if name in mismatched),
            )
        )
    computed_steps = sum(b.num_computed_tokens is not None for b in steps)
    specs = specs if specs is not None else {"fla": _tables.Fla(chunk_size)}
    kinds = frozenset(type(spec).__name__ for spec in specs.values())
    return Replay(results, service.builder.backend, tables, tuple(specs), kinds, service.stats(), computed_steps)


_ROW_WORDS = {"Fla": "FLA chunk rows (NT)", "Conv": "conv1d 8-token blocks", "Mamba2": "Mamba2 SSD chunks"}
_SET_WORDS = {
    "all": "a Kimi-Linear/Qwen3-Next step's tables (FLA prefill + batch, conv1d) and a vLLM Mamba2 step's "
    "(SSD chunks, conv1d of the prefill rows), one build",
    "kda": "a Kimi-Linear/Qwen3-Next step's tables (FLA prefill + batch, conv1d), one build",
    "mamba2": "a vLLM Mamba2 step's tables (SSD chunks, conv1d of the prefill rows), one build",
    "fla": "the FLA prefill table (the FLA-only service)",
}


def report(run: Replay, *, device: str, backend: str, fla_skipped: bool = False) -> str:
    """The per-step table and the summary; ``backend`` is the one asked for (``auto`` is resolved
    by the builder, and the report says to what)."""
    results = run.steps
    has_fla = any(r.fla_host_us is not None for r in results)
    has_device = any(r.device_us is not None for r in results)
    widths = {name: max(6, len(name)) for name in run.names}
    header = f"{'step':>4} {'N':>5} {'T':>7}" + "".join(f" {name:>{w}}" for name, w in widths.items())
    header += f" {'host_us':>8} {'b2b_us':>8}"
    header += f" {'fla_us':>8}" if has_fla else ""
    header += f" {'dev_us':>7}" if has_device else ""
    lines = [header + "  match"]
    for k, r in enumerate(results):
        line = f"{k:>4} {r.num_seqs:>5} {r.num_tokens:>7}"
        line += "".join(f" {r.rows[name]:>{w}}" for name, w in widths.items())
        line += f" {r.host_us:>8.1f} {r.back_to_back_us:>8.1f}"
        if has_fla:
            line += f" {r.fla_host_us:>8.1f}"
        if has_device:
            line += f" {r.device_us:>7.2f}"
        lines.append(line + ("  ok" if r.matched else f"  MISMATCH:{','.join(r.mismatched)}"))
    host = [r.host_us for r in results]
    back_to_back = [r.back_to_back_us for r in results]
    mismatches = sum(not r.matched for r in results)
    per_table = ", ".join(f"{name} {sum(name in r.mismatched for r in results)}" for name in run.names)
    lines.append("")
    chosen = f"{run.backend} (chosen by auto)" if backend == "auto" else run.backend
    lines.append(f"steps: {len(results)}  mismatches: {mismatches} ({per_table})  device: {device}  backend: {chosen}")
    lines.append(f"tables: {run.tables} = {_SET_WORDS[run.tables]}, through ChunkMetaService, strict")
    legend = ", ".join(words for kind, words in _ROW_WORDS.items() if kind in run.kinds)
    lines.append(f"rows per table: {legend}; every table of every repeat checked against chunkmeta.reference")
    if run.tables in ("all", "mamba2"):
        absent = len(results) - run.computed_steps
        lines.append(
            f"num_computed_tokens: from the trace in {run.computed_steps} of {len(results)} steps"
            + (f" (0 for every request in the other {absent})" if absent else "")
        )
    lines.append(
        f"chunkmeta host us per build: p50 {median(host):.1f}  p99 {percentile(host, 99):.1f} (each after a "
        f"reference check, caches cold as between engine steps); back to back p50 {median(back_to_back):.1f}"
    )
    stats = run.stats
    lines.append(
        f"service stats: {stats.builds} builds, host us p50 {stats.host_us_p50:.1f}  p99 {stats.host_us_p99:.1f}, "
        f"capacity use: seqs {stats.seqs_use:.2f}  tokens {stats.tokens_use:.2f}  rows {stats.rows_use:.2f}"
    )
    if has_fla:
        fla = [r.fla_host_us for r in results]
        what = "" if len(run.names) == 1 else f", building all {len(run.names)} tables"

        def against(ours):
            ratio = median(fla) / median(ours)
            return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"

        # FLA's calls run back to back (a fresh tensor each, past its identity cache): the first
        # ratio sets chunkmeta's cold calls against them, the second like against like
        lines.append(
            f"FLA prepare_chunk_indices+prepare_chunk_offsets host us (back to back): p50 {median(fla):.1f}  "
            f"p99 {percentile(fla, 99):.1f}  (chunkmeta is {against(host)} at p50 cold, "
            f"{against(back_to_back)} back to back{what})"
        )
    elif fla_skipped:
        lines.append("FLA comparison: skipped (--no-fla)")
    elif "fla" not in run.names:
        lines.append("FLA comparison: no FLA table in this set")
    else:
        lines.append("FLA comparison: fla-core not installed (pip install fla-core==0.6.0)")
    if has_device:
        dev = [r.device_us for r in results]
        lines.append(f"chunkmeta device us per build: p50 {median(dev):.2f}  p99 {percentile(dev, 99):.2f}")
    lines.append("GPU figures (H200 and H100 records): bench/RESULTS.md and docs/gpu.md in the chunkmeta source tree.")
    return "\n".join(lines)

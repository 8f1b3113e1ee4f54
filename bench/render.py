"""bench/RESULTS.md from the records of bench/results/runs.jsonl (``python bench/results.py render``).

Per benchmark family (a record's ``kind``), in ``FAMILIES``' order: a table of its latest record
(an ``experiment`` or ``flawed`` record is never the latest), then one line per record, newest first. The tables are
generic: the rows a family's figures hold, a field per table row or column, each per-method
object in one cell; ``Family`` says where the rows are and which figures the history line shows.
Standard library only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How RESULTS.md shows one benchmark family.

    rows     the figures key that holds the latest table's rows (a list of objects, an object of
             objects or of numbers); None: the figures are the one row
    label    a row's column head (a format over the row)
    cell     formats tried in turn on each object in a row (one method's figures)
    summary  the history line: formats separated by "; ", each the range it takes over the rows
    block    a figures key of text lines, shown as they are
    also     a second figures key of rows that the history line reads too (a record may hold
             only those: its family's latest table is the latest record with ``rows``)
    """

    title: str
    about: str
    rows: str | None = None
    cell: tuple = ()
    summary: str = ""
    block: str | None = None
    label: str = "{key}"
    also: str | None = None


FAMILIES = {  # in RESULTS.md's order: the README's headline families first
    "vllm_engine": Family(
        "vLLM's own engine serving a hybrid model",
        "bench/vllm_engine.py: vLLM 0.33.0's `LLM` engine (Model Runner V2, torch.compile, CUDA graphs, its "
        "scheduler) serving dummy-weight models of published shapes, a closed loop at a fixed concurrency as "
        "`vllm bench serve` runs one; methods `vllm` (chunkmeta off), `chunkmeta` (`CHUNKMETA_VLLM=1`), "
        "`chunkmeta_graphs` (plus `CHUNKMETA_VLLM_FULL_GRAPH=1`). Cells: total tokens/s, mean TTFT, mean TPOT.",
        rows="rows",
        label="{model} {workload} c={concurrency}",
        cell=(
            "{total_tok_s:.0f} tok/s, TTFT {mean_ttft_ms:.1f} ms, TPOT {mean_tpot_ms:.2f} ms",
            "{total_tok_s:.0f} tok/s, TTFT {mean_ttft_ms:.1f} ms",
        ),
        summary="chunkmeta {chunkmeta_vs_vllm[tok_s_gain_pct]:+.2f}% tok/s; "
        "TTFT {chunkmeta_vs_vllm[ttft_ratio]:.3f}x; TPOT {chunkmeta_vs_vllm[tpot_ratio]:.3f}x",
    ),
    "step_tables": Family(
        "A whole step's tables",
        "bench/step_tables.py: one `StepTablesBuilder.build` of a step's tables against vLLM 0.33.0's own functions "
        "for the same tables. Cells: host µs p50 queue idle / cold / busy, then device µs; `vllm_*_step_us`: the "
        "sums of vLLM's parts; `ratio_*`: vLLM / chunkmeta host time (idle; `_cold`: cold).",
        rows="rows",
        label="{decodes} + {prefills} x {tokens}",
        cell=(
            "{host_idle_us:.1f} / {host_cold_us:.1f} / {host_busy_us:.1f}, {device_us:.2f}",
            "{host_idle_us:.1f} / {host_cold_us:.1f} / {host_busy_us:.1f}",
            "{host_idle_us:.1f} / {host_busy_us:.1f}",
        ),
        summary="KDA/GDN {methods[chunkmeta_kda_gdn][host_idle_us]:.1f} µs; "
        "device {methods[chunkmeta_kda_gdn][device_us]:.2f} µs; {ratio_kda_gdn:.1f}x vLLM; "
        "Mamba2 {methods[chunkmeta_mamba2][host_idle_us]:.1f} µs; {ratio_mamba2:.1f}x vLLM; "
        "all five {methods[chunkmeta_hybrid][host_idle_us]:.1f} µs; "
        "one-shot {methods[chunkmeta_oneshot][host_idle_us]:.1f} µs; "
        "floor {methods[floor][host_idle_us]:.1f} µs",
    ),
    "vllm_step_loop": Family(
        "vLLM engine-like step loop",
        "bench/vllm_step_loop.py: steps of vLLM 0.33.0's own code (the runner's inputs, the builder's `build()`, "
        "Kimi-Linear KDA layers), vLLM's metadata path against chunkmeta's, interleaved step by step.",
        rows="rows",
        label="{concurrency} requests",
        cell=("{ms_per_step:.3f} ms/step, {syncs_per_step} syncs, build() {build_host_us:.0f} µs",),
        summary="{speedup:.3f}x at {concurrency}; syncs {vllm[syncs_per_step]} / {chunkmeta[syncs_per_step]}; "
        "bit-identical {bit_identical}",
    ),
    "vllm_full_graph": Family(
        "vLLM mixed step in one CUDA graph",
        "bench/vllm_full_graph.py: a Kimi-Linear mixed prefill+decode step on vLLM 0.33.0's own ops, a new random "
        "batch every step: vLLM's piecewise graphs (GEMMs captured, linear-attention ops eager) with vLLM's or "
        "chunkmeta's metadata, against the whole step in one graph per bucket (`integrations/vllm/mixed_step.py`).",
        rows="steps",
        label="{requests} x {tokens}",
        cell=(  # records before the pipelined figures have no async_ms_per_step: the second format
            "{ms_per_step:.3f} ms/step (async {async_ms_per_step:.3f}), {syncs_per_step} syncs",
            "{ms_per_step:.3f} ms/step, {syncs_per_step} syncs",
        ),
        summary="full {speedup_full:.2f}x vllm_piecewise at {requests} x {tokens}; "
        "async {speedup_full_async:.2f}x; states equal {states_equal}; "
        "exact {layer} {requests} x {tokens}, {batches} batches: bit-identical {bit_identical}",
        also="exact",
    ),
    "vllm_mamba2_exact": Family(
        "vLLM Mamba2 mixed step in one CUDA graph: exactness",
        "bench/vllm_mamba2_exact.py: one Mamba2 layer at Nemotron-Nano-9B-v2's mixer sizes, vLLM 0.33.0's own "
        "`conv_ssm_forward` on its builder's metadata against the patched one on a chunkmeta bucket, captured once "
        "and replayed: batches whose outputs and states are bit-identical, and one layer's step time each side "
        "(a one-layer harness figure).",
        cell=(
            "{requests} x {tokens}: {batches} batches, identical {identical_batches}; "
            "vLLM eager {median_vllm_eager_us:.0f} µs, chunkmeta graph {median_chunkmeta_graph_us:.0f} µs",
            "{requests} x {tokens}: {batches} batches, identical {identical_batches}",
        ),
        summary="{requests} x {tokens}, decodes {decodes}, levels {levels}: {batches} batches, "
        "identical {identical_batches}",
    ),
    "sglang_mamba2": Family(
        "SGLang's Mamba2 extend metadata",
        "bench/sglang_mamba2.py: host µs per forward (median) and syncs counted, SGLang 0.5.23's own "
        "`init_forward_metadata` / `prepare_mixed` against chunkmeta's.",
        rows="rows",
        label="{rows} x {tokens_per_row}, cached prefix {cached_prefix}",
        cell=("{host_us:.1f} µs, {syncs} syncs",),
        summary="SGLang {methods[stock_init][syncs]} syncs; {methods[stock_init][host_us]:.0f} µs; "
        "chunkmeta {methods[chunkmeta_init][host_us]:.0f} µs; {ratio_init:.1f}x",
    ),
    "gpu_compare": Family(
        "chunkmeta against the anchors",
        "bench/gpu_compare.py: one FLA table set per build against FLA's helpers and other anchors "
        "(bench/anchors.py). Cells: host µs p50 queue idle / busy, device µs (*: the method syncs).",
        rows="results",
        cell=("{host_idle_p50:.1f} / {host_busy_p50:.1f} / {device_us:.2f}",),
        summary="chunkmeta {chunkmeta[host_idle_p50]:.1f} µs; device {chunkmeta[device_us]:.2f} µs; "
        "fla_sync {fla_sync[host_idle_p50]:.0f} µs",
    ),
    "gpu_ab": Family(
        "Old and new tree side by side",
        "bench/diagnostics/ab_compare.py: gpu_compare and step_tables run in two trees, alternating, several "
        "times in one command; per chunkmeta method and workload the medians over each tree's runs, new / old "
        "(`floor`: the launch floor, the runs' drift).",
        rows="rows",
        label="{kind} {workload} {method} {metric}",
        summary="guard (new / old <= {limit}) met {guard_met}; worst {worst[ratio]:.3f} ({worst[kind]} "
        "{worst[workload]} {worst[method]} {worst[metric]}); against {old_commit}",
    ),
    "ab_host": Family(
        "Old and new tree in one process",
        "bench/diagnostics/ab_host.py: each chunkmeta build of the current tree and its twin in an old tree, "
        "loaded side by side in one process and interleaved; per build the median over rounds of each tree's "
        "host p50 (and device µs on CUDA), new / old, and whether the twins' tables are equal.",
        rows="rows",
        label="{workload} {build}",
        summary="guard (new / old <= {limit}) met {guard_met}; host median ratio {host_median_ratio:.3f}; worst "
        "{worst[workload]} {worst[build]}; against {old_commit} on {device_kind}",
    ),
    "vllm_builders": Family(
        "vLLM's metadata builders",
        "bench/vllm_builders.py: host µs of one `build()` of vLLM 0.33.0's real builders, stock against "
        "chunkmeta's builder of the same class.",
        rows="rows",
        summary="stock / chunkmeta {ratio:.1f}x; fallbacks {fallbacks}",
    ),
    "step_loop": Family(
        "Engine-like step loop",
        "bench/step_loop.py: per step, the scheduler's copy of `query_start_loc`, the metadata, then FLA KDA "
        "layers; methods interleaved step by step.",
        rows="rows",
        label="{load}",
        cell=("{ms_per_step:.3f} ms/step, {ratio_to_fla:.3f}x fla, {dtoh_copies_per_step} DtoH", "{error}"),
        summary="chunkmeta {chunkmeta[ratio_to_fla]:.3f}x fla; whole step in a graph "
        "{chunkmeta_cudagraph[ratio_to_fla]:.3f}x; bit-identical {bit_identical}",
    ),
    "demo": Family(
        "The main job on the GPU",
        "`python -m chunkmeta` (`make demo`): the embedded trace replayed, every step checked against "
        "`chunkmeta.reference`.",
        summary="{mismatches} mismatches; {host_us_p50} µs cold; {host_back_to_back_us_p50} µs back to back; "
        "FLA {fla_us_p50} µs; device {device_us_p50} µs",
    ),
    "gpu_tests": Family(
        "GPU tests",
        "`pytest -m gpu` on the GPU (what the tests cover: docs/gpu.md).",
        summary="{passed} passed, {failed} failed, {errors} errors, {skipped} skipped in {seconds:.0f} s",
    ),
    "diag_launch": Family(
        "Where a build's host time goes",
        "bench/diagnostics/diag_launch.py: host µs per call, medians of 2,000 calls back to back.",
        rows="us",
        summary="step build {step build:.1f} µs; one-shot {one-shot build:.1f} µs",
    ),
    "stress": Family(
        "Stress",
        "bench/stress.py: random steps of every kind, each compared with `chunkmeta.reference` on the device.",
        summary="{steps} steps, {mismatches} mismatches, {steps_per_s} steps/s",
    ),
    "pytest_benchmark": Family(
        "pytest-benchmark: host time of one call",
        "bench/bench_build.py under `--benchmark-enable`: µs per call.",
        rows="tests",
        summary="median {median_us:.1f} µs",
    ),
    "kernel_sweep": Family(
        "Kernel sweeps",
        "bench/kernel_sweep.py: device µs per build of each fill launched alone (median of 5 x 200 launches); "
        "configurations Triton BLOCK_ROWS/num_warps/SCAN_COLS, CUDA C THREADS/BLOCK_ROWS.",
        rows="workloads",
        cell=(
            "{default} {us:.2f} µs (I/O floor {io_floor:.2f}); fastest {configs[0][0]} {configs[0][1]:.2f}, "
            "{configs[1][0]} {configs[1][1]:.2f}, {configs[2][0]} {configs[2][1]:.2f}",
            "{default} {us:.2f} µs (I/O floor {io_floor:.2f})",
            "{default} {us:.2f} µs",
        ),
        summary="CUDA C {cuda[us]:.2f} µs; Triton {triton[us]:.2f} µs; empty launch {empty_launch:.2f} µs; "
        "fastest CUDA C {cuda[configs][0][0]}; fastest Triton {triton[configs][0][0]}",
    ),
    "kernel_variants": Family(
        "Kernel variants",
        "Kernel changes measured on the GPU and not kept (why: docs/gpu.md); the newest one's sweep below.",
        summary="{title}",
        block="lines",
    ),
    "launch_floor": Family(
        "Launch floor through gpu_compare's setup",
        "bench/diagnostics/launch_floor.py: an empty launch's device µs after each gpu_compare workload's setup.",
        rows="workloads",
        summary="after setup {after_setup:.2f} µs",
    ),
    "graph_floor": Family(
        "Launch floor against captured CUDA graphs",
        "bench/diagnostics/graph_floor.py: an empty launch's device µs after capturing 0, 1, ... trivial graphs.",
        rows="graphs",
        label="{key} graphs",
        summary="{value:.2f} µs",
    ),
    "launch_paths": Family(
        "Launch paths",
        "bench/launch_paths.py: device µs per build of one kernel through each launch path.",
        rows="workloads",
    ),
}
TRANSPOSE_UP_TO = 8  # rows: up to this many, the table's columns are the rows (fields read down)


def _num(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _is_table(value) -> bool:
    """Objects of objects and lists of objects are tables of their own."""
    items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    return bool(items) and all(isinstance(v, dict) for v in items)


def _auto(value) -> str:
    if value is None or value == [] or value == {}:
        return "—"
    if isinstance(value, list) and _is_table(value):
        return f"{len(value)} rows in runs.jsonl"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_auto(v)}" for k, v in value.items())
    if isinstance(value, list):
        shown = "; ".join(_auto(v) for v in value[:5])
        return shown + (f"; +{len(value) - 5} more in runs.jsonl" if len(value) > 5 else "")
    return _num(value).replace("|", "/").replace("\n", " ")


def _format(fmt: str, row: dict) -> str | None:
    try:
        return fmt.format_map(row)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def _cell(cell_formats: tuple, value) -> str:
    if isinstance(value, dict):
        for fmt in cell_formats:
            text = _format(fmt, value)
            if text is not None:
                return text + ("*" if value.get("host_bound_device") else "")
    return _auto(value)


def _table_rows(data) -> list[dict]:
    if isinstance(data, dict):
        return [{"key": k, **v} if isinstance(v, dict) else {"key": k, "value": v} for k, v in data.items()]
    return list(data)


def _rows(family: Family, figures: dict) -> list[dict]:
    if family.rows is None:
        return [{k: v for k, v in figures.items() if k != family.block}]
    return _table_rows(figures.get(family.rows, []))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def _grid(rows: list[dict], label: str, cell_formats: tuple = ()) -> list[str]:
    """One table of rows: a row's nested object of per-method objects gives a field per method;
    up to TRANSPOSE_UP_TO rows read down (a column each), more read across."""
    rows = [
        {k: w for k, v in row.items() for k, w in (v.items() if isinstance(v, dict) and _is_table(v) else [(k, v)])}
        for row in rows
    ]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    cells = {f: [_cell(cell_formats, row.get(f)) for row in rows] for f in fields}
    if len(rows) > TRANSPOSE_UP_TO:
        return _table(fields, [[cells[f][i] for f in fields] for i in range(len(rows))])
    labels = [_format(label, row) or "value" for row in rows]
    return _table(["figure", *labels], [[f, *cells[f]] for f in fields if cells[f] != labels])


def latest_table(family: Family, record: dict) -> list[str]:
    figures = record["figures"]
    out = _grid(_rows(family, figures), family.label, family.cell)
    if family.rows is None:
        return out
    others = {k: v for k, v in figures.items() if k not in (family.rows, family.block)}
    for name, value in others.items():
        if _is_table(value):
            out += [f"`{name}`:", ""] + _grid(_table_rows(value), "{key}")
    params = [f"{k} {_auto(v)}" for k, v in others.items() if not _is_table(v)]
    out += ["Parameters: " + "; ".join(params), ""] if params else []
    if family.block:
        out += ["```", *figures.get(family.block, []), "```", ""]
    return out


def _span(texts: list[str]) -> str:
    """One figure over a record's rows: the value, a range lo–hi where only the first number
    differs, or the values (their shared leading words once)."""
    if len(set(texts)) == 1:
        return texts[0]
    parts = [re.fullmatch(r"(\D*?)(-?\d+(?:\.\d+)?)(.*)", t) for t in texts]
    if all(parts) and len({(p.group(1), p.group(3)) for p in parts}) == 1:
        lo, hi = (f(parts, key=lambda p: float(p.group(2))) for f in (min, max))
        return f"{lo.group(1)}{lo.group(2)}–{hi.group(2)}{lo.group(3)}"
    prefix = os.path.commonprefix(texts).rpartition(" ")[0]  # a label they share, once
    return (prefix + " " if prefix else "") + ", ".join(dict.fromkeys(t[len(prefix) :].strip() for t in texts))


def summary(family: Family, record: dict) -> str:
    """The history line: each of the family's summary formats over the record's rows (and, for
    rows of named numbers, over one object of them, so that a format can name them), else over
    the record's figures."""
    rows = _rows(family, record["figures"])
    rows += _table_rows(record["figures"].get(family.also, [])) if family.also else []
    if rows and all(set(r) == {"key", "value"} for r in rows):
        rows.append({str(r["key"]): r["value"] for r in rows})
    items = []
    for fmt in filter(None, family.summary.split("; ")):
        texts = [t for t in (_format(fmt, row) for row in rows) if t is not None]
        # a format no row answers may name the record's top-level figures (gpu_ab's guard)
        texts = texts or [t for t in [_format(fmt, record["figures"])] if t is not None]
        texts = [re.sub(r"\bTrue\b", "yes", re.sub(r"\bFalse\b", "NO", t)) for t in texts]
        items += [_span(texts)] if texts else []
    return "; ".join(items).replace("|", "/") or "—"


def _note(record: dict) -> str:
    return " ".join(f"{k}: {record[k]}" for k in ("experiment", "flawed", "note") if k in record).replace("|", "/")


def latest_record(family: Family, runs: list[dict]) -> dict:
    """The record a family's table shows, of its records sorted by date: the newest that is no
    experiment, flawed record nor smoke run and holds the family's rows (a record of ``also``
    only does not)."""
    kept = [r for r in runs if "experiment" not in r and "flawed" not in r and not r["figures"].get("smoke")]
    kept = [r for r in kept if family.rows is None or r["figures"].get(family.rows)] or kept
    return (kept or runs)[-1]


def render(records: list[dict]) -> str:
    lines = [
        "# Results",
        "",
        "<!-- Generated by `python bench/results.py render` from bench/results/runs.jsonl. Do not edit: "
        "append records with `python bench/results.py add FILE...` and render again. -->",
        "",
        f"Every figure below is a record's, from `bench/results/runs.jsonl` ({len(records)} records), named by "
        "its id. Per benchmark family: its latest record (an `experiment` or a `flawed` record is never the "
        "latest), then one line per record, newest first. How to run the benchmarks and read the figures: "
        "[docs/gpu.md](../docs/gpu.md).",
        "",
    ]
    for kind, family in FAMILIES.items():
        runs = sorted((r for r in records if r["kind"] == kind), key=lambda r: r["date"])
        if not runs:
            continue
        latest = latest_record(family, runs)
        device = ", ".join(f"{k} {v}" for k, v in latest["device"].items())
        lines += [f"## {family.title} (`{kind}`)", "", family.about, ""]
        lines += [f"Latest: `{latest['id']}`, commit {latest['commit']}, `{latest['command']}`; {device}."]
        lines += ([_note(latest)] if _note(latest) else []) + [""] + latest_table(family, latest)
        history = [
            [f"`{r['id']}`", r["commit"][:12], r["device"].get("gpu", "?"), summary(family, r), _note(r)]
            for r in reversed(runs)
        ]
        lines += [f"### Every `{kind}` record", ""] + _table(["record", "commit", "device", "figures", "note"], history)
    return "\n".join(lines).rstrip() + "\n"

"""Benchmark runs: one append-only data file, and bench/RESULTS.md generated from it.

    python bench/results.py render [--check]             bench/RESULTS.md from bench/results/runs.jsonl
    python bench/results.py add FILE... [--commit REV]   append records made on a GPU machine
    python bench/results.py gather DIR [--to FILE]       DIR/*.runs.jsonl -> DIR/runs.jsonl (or FILE)
    python bench/results.py record KIND FILE --out DIR --command CMD
                                                         a record from a stage's own output:
                                                         gpu_tests (pytest log), pytest_benchmark
                                                         (its --benchmark-json), demo (its log)

The GPU benchmark scripts write their records under their ``--out`` directory
(``<kind>.runs.jsonl``); ``bench/run_gpu.sh`` gathers them into ``$OUT/runs.jsonl``; ``add``
appends that file here. A record is one JSON object per line:

* ``id``       ``kind@date``, unique: what bench/RESULTS.md and docs/gpu.md cite;
* ``kind``     gpu_compare, step_loop, stress, kernel_sweep, kernel_variants, launch_floor,
               graph_floor, launch_paths, gpu_tests, pytest_benchmark, demo, step_tables,
               sglang_mamba2, vllm_builders, vllm_step_loop;
* ``date``     UTC, ``YYYY-MM-DD HH:MM[:SS] UTC``;
* ``commit``   the code measured; "unknown" where nobody recorded it;
* ``command``  what produced it, its output directory written as ``$OUT``;
* ``device``   the GPU's name and the versions of torch, triton, fla-core, Python, NVRTC;
* ``figures``  the numbers (per kind: see the ``_render_*`` functions);
* optional: ``experiment`` (a change that was measured and not kept: such a record is never the
  "latest" of its kind), ``note``, ``source`` (the file an old record was imported from).

Standard library only: it runs on the GPU machine beside the benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "results" / "runs.jsonl"
RESULTS_MD = HERE / "RESULTS.md"
REQUIRED = ("id", "kind", "date", "commit", "command", "device", "figures")
OPTIONAL = ("experiment", "note", "source")
KINDS = (
    "gpu_compare",
    "step_loop",
    "stress",
    "kernel_sweep",
    "kernel_variants",
    "launch_floor",
    "graph_floor",
    "launch_paths",
    "gpu_tests",
    "pytest_benchmark",
    "demo",
    "step_tables",
    "sglang_mamba2",
    "vllm_builders",
    "vllm_step_loop",
    "diag_launch",
)
RECORD_SUFFIX = ".runs.jsonl"


# ---------------------------------------------------------------- making records (GPU machine)


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def record_id(kind: str, date: str) -> str:
    """``kind@2026-11-30T09:56:41Z`` from ``2026-11-30 09:56:41 UTC``."""
    return f"{kind}@{date.removesuffix(' UTC').replace(' ', 'T')}Z"


def checkout_commit() -> str:
    """The code being measured. CHUNKMETA_COMMIT wins: a copied checkout's git metadata can be
    older than its files (the device machine's copy once reported the session's first commit)."""
    if os.environ.get("CHUNKMETA_COMMIT"):
        return os.environ["CHUNKMETA_COMMIT"]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_info() -> dict:
    """GPU name and software versions, where importable (each missing one is left out)."""
    info = {"python": platform.python_version()}
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["fla"] = version("fla-core")
    except Exception:  # noqa: BLE001  (not installed, or its metadata unreadable: leave it out)
        pass
    try:
        from chunkmeta.fill import cuda_fill

        nvrtc = cuda_fill.nvrtc_version()
        if nvrtc:
            info["nvrtc"] = nvrtc
    except Exception:  # noqa: BLE001  (no CUDA C fill here: leave it out)
        pass
    return {k: info[k] for k in ("gpu", "torch", "triton", "fla", "python", "nvrtc") if k in info}


def command_line(argv: list[str], out: str | os.PathLike | None = None) -> str:
    """The command as run, with the output directory written as $OUT (no machine paths)."""
    words = ["python", *argv]
    if out is not None:
        words = ["$OUT" if w == str(out) else w.replace(f"={out}", "=$OUT") for w in words]
    return " ".join(words)


def make_record(
    kind: str,
    figures: dict,
    *,
    command: str,
    date: str | None = None,
    commit: str | None = None,
    device: dict | None = None,
    **optional,
) -> dict:
    date = date or utc_now()
    record = {
        "id": record_id(kind, date),
        "kind": kind,
        "date": date,
        "commit": commit or checkout_commit(),
        "command": command,
        "device": device if device is not None else device_info(),
    }
    record.update({k: v for k, v in optional.items() if v is not None})
    record["figures"] = figures
    validate(record)
    return record


def save(kind: str, figures: dict, *, script: str, argv: list[str], out: str | os.PathLike) -> dict:
    """A benchmark script's record, written under its ``--out`` directory."""
    record = make_record(kind, figures, command=command_line([script, *argv], out))
    write_record(out, record)
    return record


def write_record(out_dir: str | os.PathLike, record: dict) -> Path:
    """Append ``record`` to ``out_dir/<kind>.runs.jsonl`` (run_gpu.sh gathers those files)."""
    path = Path(out_dir) / f"{record['kind']}{RECORD_SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


# ---------------------------------------------------------------- stage outputs -> figures


def gpu_tests_figures(log: str) -> dict:
    """Counts, duration, skip reasons and slowest tests from a pytest log (-ra --durations)."""
    summary = [ln for ln in log.splitlines() if re.match(r"=*\s*\d+ (passed|failed|error)", ln.strip("= "))]
    if not summary:
        raise ValueError("no pytest summary line (N passed ... in S s) in the log")
    last = summary[-1].strip("= ")
    figures = {k: 0 for k in ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")}
    for count, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", last):
        figures["errors" if word.startswith("error") else word] = int(count)
    figures["seconds"] = float(re.search(r" in ([\d.]+)s", last).group(1))
    figures["skip_reasons"] = re.findall(r"^SKIPPED \[\d+\] (.*)$", log, re.M)
    figures["failures"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
    figures["slowest"] = [
        {"seconds": float(s), "test": t}
        for s, t in re.findall(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)$", log, re.M)
    ]
    return figures


def pytest_benchmark_figures(data: dict) -> dict:
    """µs per test from pytest-benchmark's --benchmark-json."""
    tests = {
        b["name"]: {
            "min_us": b["stats"]["min"] * 1e6,
            "median_us": b["stats"]["median"] * 1e6,
            "iqr_us": b["stats"]["iqr"] * 1e6,
            "rounds": b["stats"]["rounds"],
        }
        for b in data["benchmarks"]
    }
    return {"tests": tests}


def demo_figures(log: str) -> dict:
    """The main job's per-step table and summary (``python -m chunkmeta``'s output)."""
    figures: dict = {"per_step": []}
    names = {
        "step": "step",
        "N": "num_seqs",
        "T": "num_tokens",
        "NT": "num_chunks",
        "host_us": "host_us",
        "b2b_us": "back_to_back_us",
        "fla_us": "fla_us",
        "dev_us": "device_us",
        "match": "match",
    }
    header = None
    for ln in log.splitlines():
        cells = ln.split()
        if cells[:1] == ["step"] and not ln.startswith("steps:"):
            header = [names.get(c, c) for c in cells]  # the columns differ with the device and --no-fla
        elif header and len(cells) == len(header) and cells[0].isdigit():
            figures["per_step"].append(
                {k: v if k == "match" else float(v) if "." in v else int(v) for k, v in zip(header, cells, strict=True)}
            )
    patterns = {
        r"steps: (\d+)\s+mismatches: (\d+)": ("steps", "mismatches"),
        r"chunkmeta host us per build: p50 ([\d.]+)\s+p99 ([\d.]+)": ("host_us_p50", "host_us_p99"),
        r"back to back p50 ([\d.]+)": ("host_back_to_back_us_p50",),
        r"service stats: (\d+) builds, host us p50 ([\d.]+)\s+p99 ([\d.]+)": (
            "service_builds",
            "service_host_us_p50",
            "service_host_us_p99",
        ),
        r"FLA .*?host us(?: \(back to back\))?: p50 ([\d.]+)\s+p99 ([\d.]+)": ("fla_us_p50", "fla_us_p99"),
        r"chunkmeta is ([\d.]+)x faster at p50": ("speedup_p50",),
        r"([\d.]+)x faster back to back": ("speedup_back_to_back_p50",),
        r"chunkmeta device us per build: p50 ([\d.]+)\s+p99 ([\d.]+)": ("device_us_p50", "device_us_p99"),
        r"device: (\S+)": ("device",),
        r"backend: (\S+)": ("backend",),
    }
    for pattern, names in patterns.items():
        match = re.search(pattern, log)
        if match:
            for name, value in zip(names, match.groups(), strict=True):
                figures[name] = (
                    value
                    if name in ("device", "backend")
                    else (int(value) if name in ("steps", "mismatches", "service_builds") else float(value))
                )
    if "steps" not in figures:
        raise ValueError("no 'steps: N  mismatches: M' line in the demo log")
    return figures


# ---------------------------------------------------------------- the data file


def validate(record: dict) -> None:
    missing = [k for k in REQUIRED if k not in record]
    unknown = [k for k in record if k not in REQUIRED + OPTIONAL]
    if missing or unknown:
        raise ValueError(f"record {record.get('id', '?')}: missing {missing}, unknown keys {unknown}")
    if record["kind"] not in KINDS:
        raise ValueError(f"record {record['id']}: kind {record['kind']!r} is not one of {KINDS}")
    if not re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d", record["date"]) or "UTC" not in record["date"]:
        raise ValueError(f"record {record['id']}: date {record['date']!r} is not 'YYYY-MM-DD HH:MM[:SS] UTC'")
    if not isinstance(record["figures"], dict) or not isinstance(record["device"], dict):
        raise ValueError(f"record {record['id']}: figures and device must be objects")
    if re.search(r"(?<![\w$])/(root|tmp|work|home|opt)/", record["command"]):
        raise ValueError(f"record {record['id']}: command names a machine path: {record['command']!r}")


def load(path: Path = DATA) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
                validate(record)
            except ValueError as exc:
                raise SystemExit(f"{path}:{number}: {exc}") from None
            records.append(record)
    ids = [r["id"] for r in records]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise SystemExit(f"{path}: duplicate ids {duplicates}")
    return records


def add(files: list[str], commit: str | None, data: Path = DATA) -> int:
    existing = {r["id"] for r in load(data)} if data.exists() else set()
    new = []
    for name in files:
        for record in load(Path(name)):
            if commit and (record["commit"] == "unknown" or record["commit"].endswith("-dirty")):
                record["commit"] = commit
            if record["id"] in existing:
                raise SystemExit(f"{name}: {record['id']} is already in {data}")
            existing.add(record["id"])
            new.append(record)
    with data.open("a") as f:
        for record in new:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"appended {len(new)} records to {data}: " + ", ".join(r["id"] for r in new))
    return 0


def gather(directory: str, to: str | None = None) -> int:
    out = Path(to) if to else Path(directory) / "runs.jsonl"
    parts = sorted(p for p in Path(directory).glob(f"*{RECORD_SUFFIX}"))
    records = [r for p in parts for r in load(p)]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"{out}: {len(records)} records from {len(parts)} files")
    return 0


def record_from_stage(kind: str, file: str, out: str, command: str) -> int:
    text = Path(file).read_text()
    makers = {
        "gpu_tests": gpu_tests_figures,
        "demo": demo_figures,
        "pytest_benchmark": lambda t: pytest_benchmark_figures(json.loads(t)),
    }
    if kind not in makers:
        raise SystemExit(f"record: KIND must be one of {sorted(makers)}")
    print(write_record(out, make_record(kind, makers[kind](text), command=command)))
    return 0


# ---------------------------------------------------------------- rendering


def _f(value, digits=1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _times(value) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _range(values, digits=1, suffix="") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    lo, hi = _f(min(values), digits), _f(max(values), digits)
    return (lo if lo == hi else f"{lo}–{hi}") + suffix


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _sorted(records: list[dict], kind: str) -> list[dict]:
    return sorted((r for r in records if r["kind"] == kind), key=lambda r: r["date"])


def _latest(records: list[dict], kind: str) -> dict | None:
    kept = [r for r in _sorted(records, kind) if "experiment" not in r]
    return kept[-1] if kept else None


def _cite(record: dict) -> str:
    return f"`{record['id']}`"


def _about(record: dict) -> list[str]:
    device = ", ".join(f"{k} {v}" for k, v in record["device"].items())
    lines = [f"Record {_cite(record)}: commit {record['commit']}, `{record['command']}`; {device}."]
    for key in ("experiment", "note"):
        if key in record:
            lines.append(f"{key.capitalize()}: {record[key]}")
    return lines + [""]


def _note(record: dict) -> str:
    return "; ".join(record[k].replace("|", "/") for k in ("experiment", "note") if k in record)


# gpu_compare ----------------------------------------------------------------------------------

ANCHORS = ("fla_sync", "fla_host", "fla_static", "trt_style", "rocm_style")
BREAKDOWN = {  # host_breakdown part -> column name (older records lack some parts)
    "build": "build()",
    "build, fresh views": "build(), fresh views",
    "build, engine pattern (new N-sequence batch each call, as fresh views)": "build(), engine pattern",
    "C build (plan + ChunkMetadata + launch + host copy)": "C build alone",
    "C build via builder.c_build (plan + ChunkMetadata + launch + host copy + ring slot)": "builder.c_build.build",
    "Triton launcher alone": "Triton launcher alone",
    "Python plan alone": "host plan alone",
    "host plan via builder.plan": "builder.plan",
    "ChunkMetadata(...), general path only": "ChunkMetadata(...) alone",
    "empty python call": "empty Python call",
}


def _workloads(record: dict) -> dict:
    return record["figures"]["results"]


def _small(record: dict) -> list[str]:
    """Workloads up to 1024 sequences (the targets' range); the rest are reported after a ';'."""
    return [k for k, w in _workloads(record).items() if w["_workload"]["num_seqs"] <= 1024]


def _split(record: dict, values: dict, digits=1) -> str:
    small = _small(record)
    large = [k for k in values if k not in small]
    text = _range([values[k] for k in small if k in values], digits)
    return text + "".join(f"; {_f(values[k], digits)}" for k in large)


def _ratio(record: dict, method: str, metric: str) -> list[float]:
    return [w[method][metric] / w["chunkmeta"][metric] for w in _workloads(record).values()]


def _render_gpu_compare(records: list[dict]) -> list[str]:
    latest = _latest(records, "gpu_compare")
    if latest is None:
        return []
    res = _workloads(latest)
    out = [
        "## chunkmeta against the anchors",
        "",
        f"The latest run ({latest['date']}). Host = wall time of one call, p50: queue idle (calls back to "
        "back) / queue busy (one call behind ~1 ms of queued GPU work). Device = µs per call from CUDA "
        "events around 100 calls queued behind a sleep kernel; in brackets the `floor` method's (two "
        "allocations and one empty Triton launch). Ratios: anchor / chunkmeta, host idle / host busy / "
        "device (higher: chunkmeta faster); * marks an anchor that synchronizes, whose device figure is "
        "host-bound. Methods and how they are timed: bench/gpu_compare.py, bench/anchors.py.",
        "",
    ]
    out += _about(latest)
    rows = []
    for key, w in res.items():
        cm = w["chunkmeta"]
        cells = [
            key,
            f"{_f(cm['host_idle_p50'])} / {_f(cm['host_busy_p50'])}",
            f"{_f(cm['host_idle_p99'])} / {_f(cm['host_busy_p99'])}",
            f"{_f(cm['device_us'], 2)} ({_f(w['floor']['device_us'], 2)})",
            w["_workload"].get("c_build_kernel", "n/a"),
            "yes" if all(m["matched"] is not False for k, m in w.items() if k != "_workload") else "NO",
        ]
        for name in ANCHORS:
            m = w[name]
            star = "*" if m["host_bound_device"] else ""
            cells.append(
                f"{m['host_idle_p50'] / cm['host_idle_p50']:.1f} / {m['host_busy_p50'] / cm['host_busy_p50']:.1f}"
                f" / {m['device_us'] / cm['device_us']:.1f}{star}"
            )
        rows.append(cells)
    out += _table(
        [
            "workload (seqs x tokens)",
            "chunkmeta host p50 idle / busy µs",
            "p99 idle / busy µs",
            "device µs (floor)",
            "C build kernel",
            "all exact",
            *ANCHORS,
        ],
        rows,
    )
    methods = [m for m in next(iter(res.values())) if m != "_workload"]
    out += ["Every method in that run, host idle p50 / host busy p50 / device µs:", ""]
    out += _table(
        ["method", *res],
        [
            [name]
            + [
                f"{_f(w[name]['host_idle_p50'])} / {_f(w[name]['host_busy_p50'])} / {_f(w[name]['device_us'], 2)}"
                + ("*" if w[name]["host_bound_device"] else "")
                for w in res.values()
            ]
            for name in methods
        ],
    )

    runs = _sorted(records, "gpu_compare")
    out += [
        "### Every gpu_compare run",
        "",
        "Host ranges: the workloads up to 1024 sequences, then `;` the larger one(s). Host ≤ 10 µs: "
        "cells (workload x idle/busy) up to 1024 sequences at or under 10 µs. Ratios: min–max over "
        "every workload. Empty Python call: median over the workloads of the host breakdown's.",
        "",
    ]
    rows = []
    for r in runs:
        res = _workloads(r)
        cm = {k: w["chunkmeta"] for k, w in res.items()}
        met = sum(cm[k][m] <= 10.0 for k in _small(r) for m in ("host_idle_p50", "host_busy_p50"))
        empty = [b.get("empty python call") for b in r["figures"].get("host_breakdown", {}).values()]
        empty = [e for e in empty if e is not None]
        rows.append(
            [
                _cite(r),
                r["commit"],
                r["figures"].get("rounds", "n/a"),
                _split(r, {k: v["host_idle_p50"] for k, v in cm.items()}),
                _split(r, {k: v["host_busy_p50"] for k, v in cm.items()}),
                f"{met} of {2 * len(_small(r))}",
                " / ".join(_f(v["device_us"], 2) for v in cm.values())
                + f" (floor {_range([w['floor']['device_us'] for w in res.values()], 2)})",
                _range([w["floor"]["host_idle_p50"] for w in res.values()], 0),
                _f(statistics.median(empty), 2) if empty else "n/a",
                f"{_range(_ratio(r, 'fla_sync', 'host_idle_p50'), 0)}x / "
                f"{_range(_ratio(r, 'fla_sync', 'host_busy_p50'), 0)}x",
                f"{_range(_ratio(r, 'rocm_style', 'host_idle_p50'))}x / "
                f"{_range(_ratio(r, 'rocm_style', 'host_busy_p50'))}x",
                _note(r),
            ]
        )
    keys = " / ".join(_workloads(runs[-1]))
    out += _table(
        [
            "record",
            "commit",
            "rounds",
            "host idle µs",
            "host busy µs",
            "host ≤ 10 µs",
            f"device µs {keys}",
            "floor host idle µs",
            "empty Python call µs",
            "x fla_sync idle / busy",
            "x rocm_style idle / busy",
            "note",
        ],
        rows,
    )

    out += [
        "### Where the host time goes",
        "",
        "chunkmeta's build and its parts alone (gpu_compare's host breakdown: medians of 2,000 single "
        "calls, µs; the workloads up to 1024 sequences, then `;` the larger one). What each part is: "
        "docs/gpu.md.",
        "",
    ]
    measured = [r for r in runs if r["figures"].get("host_breakdown")]
    names = [n for n in BREAKDOWN if any(n in p for r in measured for p in r["figures"]["host_breakdown"].values())]
    rows = []
    for r in measured:
        parts = r["figures"]["host_breakdown"]
        rows.append(
            [_cite(r)]
            + [
                _split(r, {k: p[name] for k, p in parts.items() if name in p}, 2)
                if any(name in p for p in parts.values())
                else "n/a"
                for name in names
            ]
        )
    out += _table(["record", *(BREAKDOWN[n] for n in names)], rows)
    return out


# kernel sweeps --------------------------------------------------------------------------------


def _configs(pairs, count=3) -> str:
    return "  ".join(f"{c}:{us:.2f}" for c, us in pairs[:count]) or "default only"


def _sweep_cell(w: dict | None) -> str:
    if w is None:
        return "n/a"
    triton, cuda = w.get("triton") or {}, w.get("cuda") or {}
    return f"{_f(triton.get('us'), 2)} / {_f(cuda.get('us'), 2)} ({_f(w.get('empty_launch'), 2)})"


def _render_kernel_sweep(records: list[dict]) -> list[str]:
    latest = _latest(records, "kernel_sweep")
    if latest is None:
        return []
    out = [
        "## Kernel sweeps",
        "",
        "Device µs per build of each fill launched alone on fixed buffers (median of 5 x 200 launches, no "
        "CUDA graphs in the process; bench/kernel_sweep.py). Diagnostics: an empty one-program launch (the "
        "floor every figure includes), the Triton fill without its row search, an I/O floor kernel per "
        "fill (its loads and stores, no scan, no search), an empty CUDA kernel at the CUDA C fill's grid. "
        "Triton configurations are BLOCK_ROWS/num_warps/SCAN_COLS, CUDA C fill ones THREADS/BLOCK_ROWS; "
        "the fastest three of each are listed.",
        "",
    ]
    out += _about(latest)
    rows = []
    for w in latest["figures"]["workloads"]:
        t, c = w.get("triton") or {}, w.get("cuda") or {}
        rows.append(
            [
                w["key"],
                w["capacity"],
                w["num_chunks"],
                _f(w.get("empty_launch"), 2),
                f"{t.get('default', 'n/a')} {_f(t.get('us'), 2)}" if t else "n/a",
                _f(t.get("no_row_search"), 2),
                _f(t.get("io_floor"), 2),
                _configs(t.get("configs", [])),
                f"{c.get('default', 'n/a')} {_f(c.get('us'), 2)}" if c else "n/a",
                _f(c.get("empty_kernel"), 2),
                _f(c.get("io_floor"), 2),
                _configs(c.get("configs", [])),
            ]
        )
    out += _table(
        [
            "workload",
            "capacity",
            "NT",
            "empty launch",
            "Triton default",
            "no row search",
            "I/O floor",
            "fastest Triton",
            "CUDA C default",
            "empty kernel at its grid",
            "I/O floor",
            "fastest CUDA C",
        ],
        rows,
    )
    runs = _sorted(records, "kernel_sweep")
    keys = [w["key"] for w in runs[-1]["figures"]["workloads"]]
    out += ["### Every kernel sweep", "", "Per workload: Triton default / CUDA C default µs (empty launch).", ""]
    rows = []
    for r in runs:
        cells = {w["key"]: w for w in r["figures"]["workloads"]}
        rows.append([_cite(r), r["commit"], *(_sweep_cell(cells.get(k)) for k in keys), _note(r)])
    return out + _table(["record", "commit", *keys, "note"], rows)


def _render_diagnostics(records: list[dict]) -> list[str]:
    out = []
    for r in _sorted(records, "launch_floor"):
        f = r["figures"]
        out += [
            "### Launch floor through gpu_compare's setup",
            "",
            "The empty launch's device µs per call (100 calls behind a 5 ms lead, median of 5) at the "
            "start, after each gpu_compare workload's setup (each captures one CUDA graph) and methods, "
            "and after plain allocations.",
            "",
        ] + _about(r)
        rows = [["start", _f(f["start"], 2), "", ""]]
        rows += [
            [k, _f(v["after_setup"], 2), _f(v["after_methods"], 2), f"{v['allocated_mib']} / {v['reserved_mib']}"]
            for k, v in f["workloads"].items()
        ]
        rows.append(["cases freed", _f(f["cases_freed"], 2), "", f"- / {f['reserved_after_free_mib']}"])
        rows += [
            [f"after allocating {mib} MiB more", _f(us, 2), "", ""] for mib, us in f["after_allocating_mib"].items()
        ]
        out += _table(["point", "after setup µs", "after its methods µs", "allocated / reserved MiB"], rows)
    for r in _sorted(records, "graph_floor"):
        f = r["figures"]
        out += [
            "### Launch floor against captured CUDA graphs",
            "",
            "The same empty launch in a fresh process after capturing 0, 1, ... trivial graphs, and after "
            "freeing them.",
            "",
        ] + _about(r)
        out += _table(
            ["graphs captured", *f["graphs"], "freed"],
            [["device µs", *(_f(v, 2) for v in f["graphs"].values()), _f(f["graphs_freed"], 2)]],
        )
    for r in _sorted(records, "launch_paths"):
        out += [
            "### Launch paths",
            "",
            "Device µs per build of one kernel through each launch path (median of 5 x N calls behind a sleep kernel).",
            "",
        ] + _about(r)
        rows = [
            [k, w["capacity"], "  ".join(f"{p}: {us:.2f}" for p, us in w["paths"].items())]
            for k, w in r["figures"]["workloads"].items()
        ]
        out += _table(["workload", "capacity", "paths"], rows)
    return (["## Launch-floor diagnostics", ""] + out) if out else []


def _render_diag_launch(records: list[dict]) -> list[str]:
    shown = _sorted(records, "diag_launch")
    if not shown:
        return []
    names = list(shown[-1]["figures"]["us"])
    out = [
        "## Where a build's host time goes",
        "",
        "Host µs per call, medians of 2,000 calls back to back, per record (bench/diag_launch.py says what "
        "each line times).",
        "",
    ]
    for r in shown:
        out += _about(r)
    rows = [[name, *(_f(r["figures"]["us"].get(name)) for r in shown)] for name in names]
    return out + _table(["part", *(f"`{r['id']}`" for r in shown)], rows)


def _render_variants(records: list[dict]) -> list[str]:
    runs = _sorted(records, "kernel_variants")
    if not runs:
        return []
    out = [
        "## Kernel variants",
        "",
        "Kernel changes measured on the GPU (sweeps in bench/kernel_sweep.py's format, with the variant's "
        "configurations beside the kept kernel's); why each was kept or not: docs/gpu.md.",
        "",
    ]
    for r in runs:
        out += [
            f"* {_cite(r)}, commit {r['commit']}: {r['figures']['title']}",
            "",
            "  <details><summary>figures</summary>",
            "",
            "  ```",
        ]
        out += [f"  {line}" for line in r["figures"]["lines"]] + ["  ```", "", "  </details>", ""]
    return out


# tests, loops, stress, benchmarks, demo -------------------------------------------------------


def _render_gpu_tests(records: list[dict]) -> list[str]:
    runs = _sorted(records, "gpu_tests")
    if not runs:
        return []
    rows = [
        [
            _cite(r),
            r["commit"],
            f"`{r['command']}`",
            r["figures"]["passed"],
            r["figures"]["failed"],
            r["figures"]["errors"],
            r["figures"]["skipped"],
            r["figures"]["deselected"],
            _f(r["figures"]["seconds"], 0),
            "; ".join(f"{s['test']} {s['seconds']:.0f} s" for s in r["figures"]["slowest"][:2]),
            _note(r),
        ]
        for r in runs
    ]
    skips = sorted({s for r in runs for s in r["figures"]["skip_reasons"]})
    return (
        ["## GPU tests", "", "`pytest -m gpu` on the GPU (what the tests cover: docs/gpu.md).", ""]
        + _table(
            [
                "record",
                "commit",
                "command",
                "passed",
                "failed",
                "errors",
                "skipped",
                "deselected",
                "s",
                "slowest",
                "note",
            ],
            rows,
        )
        + (["Skip reasons: " + "; ".join(skips), ""] if skips else [])
    )


STEP_COLUMNS = [
    ("ms_per_step", "ms/step", 3),
    ("tokens_per_s", "tokens/s", 0),
    ("ratio_to_fla", "speed-up vs fla", 3),
    ("dtoh_copies_per_step", "DtoH copies/step", 0),
    ("sync_gap_us", "sync gap µs/step", 1),
    ("host_blocked_us", "host blocked µs/step", 0),
    ("gpu_idle_us", "GPU idle µs/step", 0),
]


_STEP_RATIOS = (  # step_tables' ratio keys (idle; "_cold" the cold ones) and their column heads
    ("ratio_kda_gdn", "vLLM / chunkmeta KDA-GDN step"),
    ("ratio_kda_gdn_vllm", "vLLM / chunkmeta KDA-GDN step as the vLLM adapter builds it"),
    ("ratio_kda_gdn_new_batch", "vLLM / chunkmeta KDA-GDN step, a new batch every call"),
    ("ratio_mamba2", "vLLM / chunkmeta Mamba2 step"),
    ("ratio_mamba2_new_batch", "vLLM / chunkmeta Mamba2 step, a new batch every call"),
    ("ratio_hybrid", "vLLM / chunkmeta hybrid step (KDA-GDN + Mamba2 tables, one build)"),
)


def _render_step_tables(records: list[dict]) -> list[str]:
    latest = _latest(records, "step_tables")
    if latest is None:
        return []
    f = latest["figures"]
    methods = list(f["rows"][0]["methods"])
    out = [
        "## A whole step's tables",
        "",
        (
            f"Host µs p50, queue idle ({f['calls']} calls back to back) / cold (a round's first call) / busy; "
            if "calls" in f
            else "Host µs p50, queue idle / busy (one call each); "
        )
        + "device µs per call where the method does not sync; methods "
        f"interleaved round by round, {f['rounds']} rounds (bench/step_tables.py says what each method is). "
        + (
            "vLLM's own functions were measured"
            + (
                f"; its KDA-GDN step is {' + '.join(f'`{p}`' for p in f['kda_gdn_step_parts'])}."
                if "kda_gdn_step_parts" in f
                else "; its KDA-GDN step is `vllm_gdn_fla` + `vllm_conv1d_batch` (no FLA batch table)."
            )
            if f["engine_functions"]
            else f"vLLM's own functions were not measured: {str(f['engine_error']).splitlines()[0][:120]}."
        ),
        "",
    ] + _about(latest)
    rows = []
    for row in f["rows"]:
        cells = []
        for name in methods:
            m = row["methods"][name]
            cold = f" / {m['host_cold_us']:.1f}" if "host_cold_us" in m else ""
            cell = f"{m['host_idle_us']:.1f}{cold} / {m['host_busy_us']:.1f}"
            if "device_us" in m:
                cell += f" / {m['device_us']:.2f}"
            cells.append(cell)
        load = f"{row['decodes']} + {row['prefills']} x {row['tokens']}"
        ratios = [
            f"{row[key]:.1f}x" + (f" / {row[key + '_cold']:.1f}x" if key + "_cold" in row else "")
            for key, _ in _STEP_RATIOS
            if key in row
        ]
        rows.append([load, *cells, *ratios, "yes" if row["exact"] else "NO"])
    first = f["rows"][0]
    ratio_heads = [head for key, head in _STEP_RATIOS if key in first]
    return out + _table(["decodes + prefills x tokens", *methods, *ratio_heads, "exact"], rows)


def _render_step_loop(records: list[dict]) -> list[str]:
    latest = _latest(records, "step_loop")
    if latest is None:
        return []
    f = latest["figures"]
    out = [
        "## Engine-like step loop",
        "",
        f"Per step: the scheduler's copy of `query_start_loc`, the metadata, then {f['layers']} layers of "
        "[GEMM, FLA KDA forward, GEMM], then the end-of-step wait; methods interleaved step by step, "
        f"medians of {f['steps']} steps; profiler columns: medians of {f['profiled_steps']} profiled steps "
        "(bench/step_loop.py says how each is measured).",
        "",
    ] + _about(latest)
    rows = []
    for row in f["rows"]:
        for method, m in ((k, v) for k, v in row.items() if isinstance(v, dict) and "available" in v):
            if not m["available"]:
                rows.append(
                    [row["load"], method, "not available: " + (m.get("error") or "?").splitlines()[0][:100]]
                    + [""] * len(STEP_COLUMNS)
                )
                continue
            cells = [f"{m[k]:,.{d}f}" if k == "tokens_per_s" else f"{m[k]:.{d}f}" for k, _, d in STEP_COLUMNS]
            cells[2] += "x"
            rows.append([row["load"], method, *cells, "yes" if m["identical_to_fla"] else "NO"])
    out += _table(["load", "method", *(name for _, name, _ in STEP_COLUMNS), "output = fla"], rows)
    out += ["### Every step-loop run", "", "Speed-up over `fla` per method: min–max over the loads.", ""]
    rows = []
    for r in _sorted(records, "step_loop"):
        methods = [
            k for k, v in r["figures"]["rows"][0].items() if isinstance(v, dict) and "available" in v and k != "fla"
        ]
        speedups = {m: [row[m]["ratio_to_fla"] for row in r["figures"]["rows"] if row[m]["available"]] for m in methods}
        identical = all(row["bit_identical"] for row in r["figures"]["rows"])
        rows.append(
            [_cite(r), r["commit"]]
            + [_range(speedups[m], 3, "x") for m in methods]
            + ["yes" if identical else "NO", _note(r)]
        )
    return out + _table(["record", "commit", *methods, "outputs = fla", "note"], rows)


METHODS_VS = ("vllm", "chunkmeta")  # vllm_step_loop: vLLM's own metadata path, then chunkmeta's


def _render_vllm_step_loop(records: list[dict]) -> list[str]:
    kept = [r for r in _sorted(records, "vllm_step_loop") if not r["figures"].get("smoke")]
    latest = _latest(kept, "vllm_step_loop")
    if latest is None:
        return []
    f = latest["figures"]
    model = f["model"]
    t = f.get("target") or {}
    verdict = {True: "met", False: "not met", None: "not measured"}
    out = [
        "## vLLM engine-like step loop",
        "",
        f"Per step, on vLLM 0.33.0's own code: the runner's inputs (pinned host buffers, non-blocking copies), "
        f"the {f['builder']} builder's `build()` (prefill backend {f['gdn_prefill_backend']}), then "
        f"{model['layers']} Kimi-Linear KDA layers of [GEMMs, `causal_conv1d_fn` x3, `chunk_kda_with_fused_gate` "
        f"(H={model['heads']}, K=V={model['head_dim']}), GEMM], hidden {model['hidden']}, {model['dtype']}, then the "
        f"end-of-step wait; vLLM's own metadata path against chunkmeta's, interleaved step by step, medians of "
        f"{f['steps']} steps "
        "(bench/vllm_step_loop.py says what is measured and left out). Issue 19's target, >= 1.05x at "
        f"{t.get('at_concurrency', 8)} requests: {verdict[t.get('faster_by_5pct_at')]}; not slower at any shape: "
        f"{verdict[t.get('not_slower_anywhere')]}.",
        "",
    ] + _about(latest)
    rows = []
    for row in f["rows"]:
        load = [row["concurrency"], f"{row['decodes']} + {row['prefill_tokens']}"]
        problem = row.get("skipped") or row.get("error")
        if problem:
            rows.append([*load, "not measured: " + str(problem).splitlines()[0].replace("|", "/")[:100], *[""] * 4])
            continue
        cells = []
        for key, digits in (("ms_per_step", 3), ("syncs_per_step", 0), ("build_host_us", 0)):
            cells.append(
                " / ".join(_f(row[k].get(key), digits) if row[k]["available"] else "failed" for k in METHODS_VS)
            )
        equal = {True: "yes", False: "NO", None: "n/a"}[row.get("bit_identical")]
        rows.append(
            [
                *load,
                cells[0],
                _f(row.get("speedup"), 3) + ("x" if row.get("speedup") else ""),
                cells[1],
                cells[2],
                equal,
            ]
        )
    out += _table(
        ["requests", "decodes + prefill tokens", "ms/step vLLM / chunkmeta", "speed-up", "syncs/step vLLM / chunkmeta",
         "build() host µs vLLM / chunkmeta", "outputs bit-identical"],
        rows,
    )  # fmt: skip
    out += [
        "### Every vLLM step-loop run",
        "",
        "Speed-up of chunkmeta's path over vLLM's: min–max over the shapes.",
        "",
    ]
    rows = []
    for r in kept:
        speedups = [row.get("speedup") for row in r["figures"]["rows"]]
        identical = [row["bit_identical"] for row in r["figures"]["rows"] if row.get("bit_identical") is not None]
        same = "NO" if False in identical else ("yes" if identical else "n/a")
        rows.append([_cite(r), r["commit"], _range(speedups, 3, "x"), same, _note(r)])
    return out + _table(["record", "commit", "speed-up", "outputs bit-identical", "note"], rows)


def _render_vllm_builders(records: list[dict]) -> list[str]:
    latest = _latest(records, "vllm_builders")
    if latest is None:
        return []
    f = latest["figures"]
    out = [
        "## vLLM's metadata builders",
        "",
        "Host µs of one `build()` of vLLM 0.33.0's real builders on prefill steps (median), stock against "
        f"chunkmeta's builder of the same class, on {f['device']}. `build()` is all of vLLM's per-step "
        "metadata work for the group, the tables chunkmeta replaces and the rest it leaves to vLLM "
        "(bench/vllm_builders.py says what each builder is).",
        "",
    ] + _about(latest)
    rows = []
    for row in f["rows"]:
        if "stock_us" not in row:
            rows.append([row["builder"], "not measured: " + row.get("skipped", ""), "—", "—", "—", "—"])
            continue
        rows.append(
            [
                row["builder"],
                f"{row['decodes']} + {row['prefills']} / {row['tokens']}",
                f"{row['stock_us']:.1f}",
                f"{row['chunkmeta_us']:.1f}",
                f"{row['ratio']:.1f}x",
                row["fallbacks"],
            ]
        )
    heads = ["builder", "decodes + prefills / tokens", "stock µs", "chunkmeta µs", "stock / chunkmeta", "fallbacks"]
    return out + _table(heads, rows)


def _render_sglang_mamba2(records: list[dict]) -> list[str]:
    latest = _latest(records, "sglang_mamba2")
    if latest is None:
        return []
    f = latest["figures"]
    out = [
        "## SGLang's Mamba2 extend metadata",
        "",
        "Host µs per forward (median) and syncs counted, SGLang 0.5.23's own `init_forward_metadata` / "
        f"`prepare_mixed` against chunkmeta's, {f['rounds']} rounds, chunk size {f['chunk_size']}, on {f['device']} "
        "(bench/sglang_mamba2.py says what each method is).",
        "",
    ] + _about(latest)
    rows = []
    for row in f["rows"]:
        m = row["methods"]
        stock, ours = m["stock_init"], m["chunkmeta_init"]
        rows.append(
            [
                f"{row['rows']} x {row['tokens_per_row']}",
                "yes" if row["cached_prefix"] else "no",
                f"{stock['host_us']:.1f} / {stock['syncs']}",
                f"{ours['host_us']:.1f} / {ours['syncs']}",
                f"{row['ratio_init']:.1f}x",
                "yes" if row["exact"] else "NO",
            ]
        )
    heads = ["rows x tokens", "cached prefix", "stock µs / syncs", "chunkmeta µs / syncs", "stock / chunkmeta", "exact"]
    return out + _table(heads, rows)


def _render_stress(records: list[dict]) -> list[str]:
    runs = _sorted(records, "stress")
    if not runs:
        return []
    rows = []
    for r in runs:
        f = r["figures"]
        rows.append(
            [
                _cite(r),
                r["commit"],
                f"{f['steps']:,}",
                f["mismatches"],
                _f(f["seconds"]),
                f"{f['steps_per_s']:,}",
                ", ".join(f"{k} {v:,}" for k, v in f["kinds"].items()),
                f"{f['memory_allocated_start_bytes']:,} / {f['memory_allocated_end_bytes']:,} / "
                f"{f['memory_peak_bytes']:,}",
                ", ".join(f"{k} {v}" for k, v in f["graph_staging_waits"].items()),
                _note(r),
            ]
        )
    return [
        "## Stress",
        "",
        "Random steps of every kind, each compared with `chunkmeta.reference` on the device; the mismatch "
        "counter read once at the end (bench/stress.py).",
        "",
    ] + _table(
        [
            "record",
            "commit",
            "steps",
            "mismatches",
            "s",
            "steps/s",
            "steps by kind",
            "CUDA allocated start / end / peak bytes",
            "graph staging waits",
            "note",
        ],
        rows,
    )


def _bench_group(tests: dict, prefix: str, metric: str, small_only=None) -> str:
    values = {k: v[metric] for k, v in tests.items() if k.startswith(prefix + "[")}
    large = [k for k in values if k.endswith("4096x1024k]")]
    small = [v for k, v in values.items() if k not in large]
    return _range(small, 1) + "".join(f"; {values[k]:.1f}" for k in large)


def _render_pytest_benchmark(records: list[dict]) -> list[str]:
    latest = _latest(records, "pytest_benchmark")
    if latest is None:
        return []
    out = [
        "## pytest-benchmark: host time of one call",
        "",
        "bench/bench_build.py under `--benchmark-enable`: µs per call of `builder.build`, a graph replay and "
        "the one-shot `build_chunk_metadata`.",
        "",
    ] + _about(latest)
    out += _table(
        ["test", "min µs", "median µs", "IQR µs", "rounds"],
        [
            [name, _f(t["min_us"], 2), _f(t["median_us"], 2), _f(t["iqr_us"], 2), t["rounds"]]
            for name, t in latest["figures"]["tests"].items()
        ],
    )
    out += [
        "### Every pytest-benchmark run",
        "",
        "min–max over the workloads up to 1024 sequences, then `;` 4096 x 1M.",
        "",
    ]
    rows = []
    for r in _sorted(records, "pytest_benchmark"):
        tests = r["figures"]["tests"]
        rows.append(
            [
                _cite(r),
                r["commit"],
                _bench_group(tests, "bench_builder_build", "min_us"),
                _bench_group(tests, "bench_builder_build", "median_us"),
                _bench_group(tests, "bench_graph_replay", "median_us"),
                _bench_group(tests, "bench_one_shot", "median_us"),
                _note(r),
            ]
        )
    return out + _table(
        [
            "record",
            "commit",
            "build() min µs",
            "build() median µs",
            "graph replay median µs",
            "one-shot median µs",
            "note",
        ],
        rows,
    )


def _render_demo(records: list[dict]) -> list[str]:
    runs = _sorted(records, "demo")
    if not runs:
        return []
    rows = [
        [
            _cite(r),
            r["commit"],
            r["figures"]["steps"],
            r["figures"]["mismatches"],
            r["figures"].get("backend", "n/a"),
            f"{_f(r['figures'].get('host_us_p50'))} / {_f(r['figures'].get('host_us_p99'))}",
            _f(r["figures"].get("host_back_to_back_us_p50")),
            f"{_f(r['figures'].get('fla_us_p50'))} / {_f(r['figures'].get('fla_us_p99'))}",
            _times(r["figures"].get("speedup_p50")),
            _times(r["figures"].get("speedup_back_to_back_p50")),
            f"{_f(r['figures'].get('device_us_p50'), 2)} / {_f(r['figures'].get('device_us_p99'), 2)}",
            _note(r),
        ]
        for r in runs
    ]
    return [
        "## The main job on the GPU",
        "",
        "`python -m chunkmeta` (`make demo`): the embedded trace replayed, every step checked against "
        "`chunkmeta.reference`.",
        "",
    ] + _table(
        [
            "record",
            "commit",
            "steps",
            "mismatches",
            "backend",
            "host µs per build p50 / p99 (cold: after a reference check)",
            "back to back p50",
            "FLA prepare_* µs p50 / p99",
            "speed-up p50 (cold)",
            "back to back",
            "device µs p50 / p99",
            "note",
        ],
        rows,
    )


def render(records: list[dict]) -> str:
    lines = [
        "# Results",
        "",
        "<!-- Generated by `python bench/results.py render` from bench/results/runs.jsonl. Do not edit: "
        "append records with `python bench/results.py add FILE...` and render again. -->",
        "",
        f"Generated by `python bench/results.py render` from `bench/results/runs.jsonl` ({len(records)} "
        "records). Every figure below is a record's; each table names its records by id. What the "
        "figures mean, why kernel variants were or were not kept, and how to run the benchmarks: "
        "[docs/gpu.md](../docs/gpu.md).",
        "",
    ]
    devices = {}
    for r in records:
        devices.setdefault(json.dumps(r["device"], sort_keys=True), []).append(r)
    lines += ["Devices and software in the records:", ""]
    lines += _table(
        ["device", "records", "dates"],
        [
            [
                ", ".join(f"{k} {v}" for k, v in json.loads(d).items()),
                len(rs),
                f"{min(r['date'] for r in rs)} – {max(r['date'] for r in rs)}",
            ]
            for d, rs in devices.items()
        ],
    )
    for section in (
        _render_gpu_compare,
        _render_kernel_sweep,
        _render_diagnostics,
        _render_variants,
        _render_gpu_tests,
        _render_step_tables,
        _render_diag_launch,
        _render_step_loop,
        _render_vllm_step_loop,
        _render_vllm_builders,
        _render_sglang_mamba2,
        _render_stress,
        _render_pytest_benchmark,
        _render_demo,
    ):
        lines += section(records)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the data file (default: bench/results/runs.jsonl)")
    parser.add_argument("--results-md", type=Path, default=RESULTS_MD, help="what render writes")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="write bench/RESULTS.md from the data file")
    p.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md is not what render writes")
    p = sub.add_parser("add", help="append the records of runs.jsonl files made on a GPU machine")
    p.add_argument("files", nargs="+")
    p.add_argument("--commit", help="the commit measured, for records that say unknown or -dirty")
    p = sub.add_parser("gather", help="collect DIR/*.runs.jsonl into DIR/runs.jsonl (or --to FILE)")
    p.add_argument("directory")
    p.add_argument("--to", help="the file to write instead of DIR/runs.jsonl")
    p = sub.add_parser("record", help="a record from a stage's output file")
    p.add_argument("kind", choices=["gpu_tests", "pytest_benchmark", "demo"])
    p.add_argument("file")
    p.add_argument("--out", required=True)
    p.add_argument("--command", required=True, dest="stage_command")
    args = parser.parse_args(argv)
    if args.command == "render":
        text = render(load(args.data))
        if args.check:
            if not args.results_md.exists() or args.results_md.read_text() != text:
                print(f"{args.results_md} is out of date: run python bench/results.py render", file=sys.stderr)
                return 1
            return 0
        args.results_md.write_text(text)
        print(f"wrote {args.results_md}")
        return 0
    if args.command == "add":
        return add(args.files, args.commit, args.data)
    if args.command == "gather":
        return gather(args.directory, args.to)
    return record_from_stage(args.kind, args.file, args.out, args.stage_command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

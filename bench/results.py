"""Benchmark runs: one append-only data file, and bench/RESULTS.md and the docs/ pictures drawn from it.

    python bench/results.py render [--check]             RESULTS.md and the pictures from bench/results/runs.jsonl
    python bench/results.py add FILE... [--commit REV]   append records made on a GPU machine
    python bench/results.py gather DIR [--to FILE]       DIR/*.runs.jsonl -> DIR/runs.jsonl (or FILE)
    python bench/results.py record KIND FILE --out DIR --command CMD
                                                         a record from a stage's own output:
                                                         gpu_tests (pytest log), pytest_benchmark
                                                         (its --benchmark-json), demo (its log)

The GPU benchmark scripts write their records under their ``--out`` directory
(``<kind>.runs.jsonl``, through ``save``); ``bench/run_gpu.sh`` gathers them into
``$OUT/runs.jsonl``; ``add`` appends that file here. A record is one JSON object per line:

* ``id``       ``kind@date``, unique: what bench/RESULTS.md and the docs cite;
* ``kind``     its benchmark family, one of ``FAMILIES``;
* ``date``     UTC, ``YYYY-MM-DD HH:MM[:SS] UTC``;
* ``commit``   the code measured; "unknown" where nobody recorded it;
* ``command``  what produced it, its output directory written as ``$OUT``;
* ``device``   the GPU's name and the versions of torch, triton, fla-core, Python, NVRTC;
* ``figures``  the numbers, as the family's script wrote them;
* optional: ``experiment`` (a change that was measured and not kept: such a record is never the
  "latest" of its family), ``flawed`` (what makes some of its figures mislead, found after the
  run: never the latest either; the figures stay as measured), ``note``, ``source`` (the file
  an old record was imported from).

``render`` writes bench/RESULTS.md (bench/render.py: per family, a table of its latest record and
one line per record), docs/host_time.png and, once a vllm_engine record has rows,
docs/engine_serving.png (bench/plot.py). Making records needs the standard library only (it runs
on the GPU machine beside the benchmarks); the pictures need numpy.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from render import FAMILIES, render

HERE = Path(__file__).resolve().parent
DATA = HERE / "results" / "runs.jsonl"
RESULTS_MD = HERE / "RESULTS.md"
PICTURE = HERE.parent / "docs" / "host_time.png"
ENGINE_PICTURE = HERE.parent / "docs" / "engine_serving.png"  # drawn once a vllm_engine record has rows
REQUIRED = ("id", "kind", "date", "commit", "command", "device", "figures")
OPTIONAL = ("experiment", "flawed", "note", "source")
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
        git = ["git", "-C", str(HERE)]
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True, check=True)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_info() -> dict:
    """GPU name and software versions, where importable (each missing one is left out)."""
    info = {"python": platform.python_version()}
    probes = {
        "gpu": _gpu_name,
        "torch": lambda: importlib.import_module("torch").__version__,
        "triton": lambda: importlib.import_module("triton").__version__,
        "fla": lambda: importlib.metadata.version("fla-core"),
        "nvrtc": lambda: importlib.import_module("chunkmeta.fill.cuda_fill").nvrtc_version(),
    }
    for key, probe in probes.items():
        try:
            info[key] = probe()
        except Exception:  # noqa: BLE001  (not installed, its metadata unreadable, no CUDA C fill: leave it out)
            pass
    return {k: info[k] for k in ("gpu", "torch", "triton", "fla", "python", "nvrtc") if info.get(k)}


def command_line(argv: list[str], out: str | os.PathLike | None = None) -> str:
    """The command as run, with the output directory written as $OUT (no machine paths)."""
    words = ["python", *argv]
    if out is not None:
        words = ["$OUT" if w == str(out) else w.replace(f"={out}", "=$OUT") for w in words]
    return " ".join(words)


def make_record(kind: str, figures: dict, *, command: str, date=None, commit=None, device=None, **optional) -> dict:
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


def write_records(path: str | os.PathLike, records: list[dict]) -> None:
    """``path`` holding ``records``, one JSON object a line (what ``load`` reads)."""
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


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
    slowest = re.findall(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)$", log, re.M)
    figures["slowest"] = [{"seconds": float(s), "test": t} for s, t in slowest]
    return figures


def pytest_benchmark_figures(data: dict) -> dict:
    """µs per test from pytest-benchmark's --benchmark-json."""
    stats = {b["name"]: b["stats"] for b in data["benchmarks"]}
    return {
        "tests": {
            name: {
                "min_us": s["min"] * 1e6,
                "median_us": s["median"] * 1e6,
                "iqr_us": s["iqr"] * 1e6,
                "rounds": s["rounds"],
            }
            for name, s in stats.items()
        }
    }


DEMO_COLUMNS = {
    "N": "num_seqs",
    "T": "num_tokens",
    "NT": "num_chunks",
    "b2b_us": "back_to_back_us",
    "dev_us": "device_us",
}
DEMO_LINES = {  # a line of the demo's summary -> the figures it holds
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


def _number(text: str):
    return float(text) if "." in text else int(text) if text.isdigit() else text


def demo_figures(log: str) -> dict:
    """The main job's per-step table and summary (``python -m chunkmeta``'s output)."""
    figures: dict = {"per_step": []}
    header = None
    for ln in log.splitlines():
        cells = ln.split()
        if cells[:1] == ["step"] and not ln.startswith("steps:"):
            header = [DEMO_COLUMNS.get(c, c) for c in cells]  # the columns differ with the device and --no-fla
        elif header and len(cells) == len(header) and cells[0].isdigit():
            figures["per_step"].append({k: _number(v) for k, v in zip(header, cells, strict=True)})
    for pattern, names in DEMO_LINES.items():
        match = re.search(pattern, log)
        if match:
            figures.update((name, _number(value)) for name, value in zip(names, match.groups(), strict=True))
    if "steps" not in figures:
        raise ValueError("no 'steps: N  mismatches: M' line in the demo log")
    return figures


# ---------------------------------------------------------------- the data file


def validate(record: dict) -> None:
    missing = [k for k in REQUIRED if k not in record]
    unknown = [k for k in record if k not in REQUIRED + OPTIONAL]
    if missing or unknown:
        raise ValueError(f"record {record.get('id', '?')}: missing {missing}, unknown keys {unknown}")
    if record["kind"] not in FAMILIES:
        raise ValueError(f"record {record['id']}: kind {record['kind']!r} is not one of {tuple(FAMILIES)}")
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
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in new)
    print(f"appended {len(new)} records to {data}: " + ", ".join(r["id"] for r in new))
    return 0


def gather(directory: str, to: str | None = None) -> int:
    out = Path(to) if to else Path(directory) / "runs.jsonl"
    parts = sorted(Path(directory).glob(f"*{RECORD_SUFFIX}"))
    records = [r for p in parts for r in load(p)]
    write_records(out, records)
    print(f"{out}: {len(records)} records from {len(parts)} files")
    return 0


STAGE_FIGURES = {
    "gpu_tests": gpu_tests_figures,
    "demo": demo_figures,
    "pytest_benchmark": lambda text: pytest_benchmark_figures(json.loads(text)),
}


def record_from_stage(kind: str, file: str, out: str, command: str) -> int:
    figures = STAGE_FIGURES[kind](Path(file).read_text())
    print(write_record(out, make_record(kind, figures, command=command)))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the data file (default: bench/results/runs.jsonl)")
    parser.add_argument("--results-md", type=Path, default=RESULTS_MD, help="what render writes")
    parser.add_argument("--picture", type=Path, default=PICTURE, help="the host-time PNG render draws")
    parser.add_argument("--engine-picture", type=Path, default=ENGINE_PICTURE, help="the engine-serving PNG")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="write bench/RESULTS.md and the pictures from the data file")
    p.add_argument("--check", action="store_true", help="exit 1 if any is not what render writes")
    p = sub.add_parser("add", help="append the records of runs.jsonl files made on a GPU machine")
    p.add_argument("files", nargs="+")
    p.add_argument("--commit", help="the commit measured, for records that say unknown or -dirty")
    p = sub.add_parser("gather", help="collect DIR/*.runs.jsonl into DIR/runs.jsonl (or --to FILE)")
    p.add_argument("directory")
    p.add_argument("--to", help="the file to write instead of DIR/runs.jsonl")
    p = sub.add_parser("record", help="a record from a stage's output file")
    p.add_argument("kind", choices=sorted(STAGE_FIGURES))
    p.add_argument("file")
    p.add_argument("--out", required=True)
    p.add_argument("--command", required=True, dest="stage_command")
    args = parser.parse_args(argv)
    if args.command == "add":
        return add(args.files, args.commit, args.data)
    if args.command == "gather":
        return gather(args.directory, args.to)
    if args.command == "record":
        return record_from_stage(args.kind, args.file, args.out, args.stage_command)
    import plot  # numpy, which making records does not need

    records = load(args.data)
    made = {
        args.results_md: (render(records).encode(), bytes.__eq__),
        args.picture: (plot.draw(records)[0], plot.same_png),
    }
    engine = plot.draw_engine(records)  # None, and no picture to check, before a vllm_engine record
    if engine:
        made[args.engine_picture] = (engine[0], plot.same_png)
    stale = [path for path, (content, same) in made.items() if not (path.exists() and same(path.read_bytes(), content))]
    for path in [] if args.check else stale:
        path.write_bytes(made[path][0])
        print(f"wrote {path}")
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python bench/results.py render", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Two trees' GPU benchmarks side by side, in alternating runs: issue 33's performance guard.

    python3 bench/diagnostics/ab_compare.py --old DIR --new DIR --out OUT [--pairs 3] [--rounds 10]
                                            [--stages "bench steptables"] [--old-commit SHA] [--new-commit SHA]
    python3 bench/diagnostics/ab_compare.py --pool A/runs.jsonl B/runs.jsonl ... --out OUT

``--pool``: one ``gpu_ab`` record from the runs of several calls of this script on one machine
(a call is bounded by the device's 10-minute limit; the guard wants more pairs than one holds).

Runs ``bash bench/run_gpu.sh <stages>`` in each tree, ``--pairs`` times each, alternating the
order (new old, old new, new old, ...), each run a fresh process. A single old/new pair in one
command is not enough for a 5% guard: the launch floor itself moved 6% between two such runs on
an H100 (gpu_compare@2026-12-05T22:57:04Z / 22:58:05Z: 2.04 against 1.92 µs), and alternating the
order puts drift (clocks, the machine's other tenants) on both trees alike.

Writes ``OUT/runs.jsonl``: every run's records (the old tree's marked as experiments, since they
do not measure the current code) and one ``gpu_ab`` record. For every chunkmeta method and
workload of ``gpu_compare`` and ``step_tables``, its rows hold the median over the runs of each
tree of the host p50 (queue idle) and the device µs, the ratio new / old, and the floors'
(``floor``: vLLM-style launches of a trivial kernel, not chunkmeta) as the drift's yardstick, and
``ratio_per_floor``: the same ratio of each run's figure over its own floor (shown, not guarded).
``guard_met``: every chunkmeta ratio at most ``--limit`` (1.05). The new tree's carried ``.whl``
and ``.vllm_bundle`` are linked into the old tree where it has none, so both import the same.
Standard library only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/: the record format
import results as runs  # the record format

# (record kind, metric in its figures, the name the guard gives it)
METRICS = {
    "gpu_compare": (("host_idle_p50", "host_p50_us"), ("device_us", "device_us")),
    "step_tables": (("host_idle_us", "host_p50_us"), ("device_us", "device_us")),
}
FLOOR = "floor"
CARRIED = (".whl", ".vllm_bundle")  # what a GPU call carries beside the tree (docs/gpu.md)


def method_figures(record: dict):
    """``(workload, method, figures)`` of every method of a gpu_compare or step_tables record."""
    f = record["figures"]
    if record["kind"] == "gpu_compare":
        for workload, methods in f["results"].items():
            for method, figures in methods.items():
                if isinstance(figures, dict) and not method.startswith("_"):
                    yield workload, method, figures
    elif record["kind"] == "step_tables":
        for row in f["rows"]:
            workload = f"{row['decodes']}+{row['prefills']}x{row['tokens']}"
            for method, figures in row["methods"].items():
                yield workload, method, figures


def exact(record: dict) -> bool:
    """Whether every chunkmeta result of a run matched the reference (step_tables' ``exact`` per
    workload, gpu_compare's ``matched`` per method): a fast but wrong tree passes no guard."""
    f = record["figures"]
    if record["kind"] == "step_tables":
        return all(row.get("exact", True) for row in f["rows"])
    return all(
        figures.get("matched") is not False
        for _, method, figures in method_figures(record)
        if method.startswith("chunkmeta")
    )


def compare(records_by_tree: dict[str, list[dict]], limit: float) -> dict:
    """The ``gpu_ab`` figures from each tree's records (a list of runs' records per tree)."""
    values: dict[tuple, dict[str, list[float]]] = {}
    per_floor: dict[tuple, dict[str, list[float]]] = {}
    for tree, records in records_by_tree.items():
        for record in records:
            found = [f for f in method_figures(record) if f[1].startswith("chunkmeta") or f[1] == FLOOR]
            floors = {workload: figures for workload, method, figures in found if method == FLOOR}
            for workload, method, figures in found:
                for key, metric in METRICS[record["kind"]]:
                    if figures.get(key) is None:
                        continue
                    cell = (record["kind"], workload, method, metric)
                    values.setdefault(cell, {}).setdefault(tree, []).append(float(figures[key]))
                    floor = floors.get(workload, {}).get(key)
                    if floor:
                        per_floor.setdefault(cell, {}).setdefault(tree, []).append(float(figures[key]) / floor)
    rows = []
    for (kind, workload, method, metric), cell in values.items():
        if "new" not in cell or "old" not in cell:
            continue  # a method only one tree has
        new, old = statistics.median(cell["new"]), statistics.median(cell["old"])
        row = {
            "kind": kind,
            "workload": workload,
            "method": method,
            "metric": metric,
            "new": round(new, 3),
            "old": round(old, 3),
            "ratio": round(new / old, 4) if old else None,
            "runs": [len(cell["new"]), len(cell["old"])],
        }
        # Shown, not guarded: each run's figure over its own floor. A process's launch floor is
        # bimodal on an H100 (device 1.82 or 1.94-2.06 us, the same in both trees) and chunkmeta's
        # device time moves with it, so a median over a few runs can land on either mode
        # (gpu_ab@2026-12-06T02:43:11Z).
        normal = per_floor.get((kind, workload, method, metric), {})
        if method != FLOOR and "new" in normal and "old" in normal:
            row["ratio_per_floor"] = round(statistics.median(normal["new"]) / statistics.median(normal["old"]), 4)
        rows.append(row)
    guarded = [r for r in rows if r["method"] != FLOOR and r["ratio"] is not None]
    worst = max(guarded, key=lambda r: r["ratio"], default=None)
    all_exact = all(exact(r) for records in records_by_tree.values() for r in records)
    return {
        "limit": limit,
        "rows": rows,
        "worst": worst,
        "over_limit": [r for r in guarded if r["ratio"] > limit],
        "all_exact": all_exact,
        "guard_met": all_exact and bool(guarded) and all(r["ratio"] <= limit for r in guarded),
    }


def pool(paths: list[Path], out: Path, limit: float) -> dict:
    """The ``gpu_ab`` record of the runs in ``paths`` (this script's outputs): a run marked as an
    experiment is the old tree's, the others the new tree's; the calls' own gpu_ab records only
    vouch that they compared the same trees on the same machine, and are not kept."""
    by_tree: dict[str, list[dict]] = {"new": [], "old": []}
    ab_records = []
    for path in paths:
        for record in runs.load(path):
            if record["kind"] == "gpu_ab":
                ab_records.append(record)
            elif record["kind"] in METRICS:
                by_tree["old" if record.get("experiment") else "new"].append(record)
    if not ab_records:
        raise SystemExit(f"no gpu_ab record in {paths}: not this script's output")
    first = ab_records[0]
    for record in ab_records[1:]:
        # a device's figures that one record has and the other not (NVRTC's version, known once a
        # fill was compiled in the process) do not tell machines apart
        device = record["device"], first["device"]
        differs = [k for k in device[0].keys() & device[1].keys() if device[0][k] != device[1][k]]
        differs += [k for k in ("commit",) if record[k] != first[k]]
        differs += [k for k in ("rounds", "stages", "old_commit") if record["figures"][k] != first["figures"][k]]
        if differs:
            raise SystemExit(f"{record['id']}: another {', '.join(differs)} than {first['id']}'s: not one A/B to pool")
    figures = {
        "pairs": sum(r["figures"]["pairs"] for r in ab_records),
        "rounds": first["figures"]["rounds"],
        "stages": first["figures"]["stages"],
        "old_commit": first["figures"]["old_commit"],
        "pooled_calls": len(ab_records),
    }
    figures.update(compare(by_tree, limit))
    command = f"python bench/diagnostics/ab_compare.py --pool ({len(ab_records)} calls)"
    record = runs.make_record("gpu_ab", figures, command=command, commit=first["commit"], device=first["device"])
    out.mkdir(parents=True, exist_ok=True)
    runs.write_records(out / "runs.jsonl", [record])
    return figures


def report(figures: dict) -> None:
    worst = figures["worst"]
    print(f"gpu_ab: guard {'met' if figures['guard_met'] else 'NOT met'} (limit {figures['limit']}); worst {worst}")
    for row in sorted(figures["rows"], key=lambda r: -(r["ratio"] or 0))[:25]:
        print(f"  {row['kind']:12s} {row['workload']:16s} {row['method']:30s} {row['metric']:12s} "
              f"new {row['new']:9.3f} old {row['old']:9.3f} ratio {row['ratio']} runs {row['runs']}")  # fmt: skip


def share_carried(new: Path, old: Path) -> None:
    """The new tree's carried wheels and engine bundle, linked into the old tree where it has
    none: with vLLM's functions in one tree's step_tables only, its processes import vLLM and
    the other's do not, which is not the same process to time."""
    for name in CARRIED:
        if (new / name).exists() and not os.path.lexists(old / name):  # a dangling link is the old tree's
            # relative: the trees travel to the GPU machine side by side, not to the same paths
            (old / name).symlink_to(os.path.relpath((new / name).resolve(), old.resolve()))


def run_tree(tree: Path, stages: list[str], out: Path, env: dict) -> list[dict]:
    """One ``run_gpu.sh`` run in ``tree``; its records (none if it wrote none)."""
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["bash", "bench/run_gpu.sh", *stages], cwd=tree, env={**os.environ, **env, "OUT": str(out)})
    path = out / "runs.jsonl"
    records = runs.load(path) if path.exists() else []
    print(f"{tree} -> rc {done.returncode}, {len(records)} records", flush=True)
    return records


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, help="the old tree")
    parser.add_argument("--pool", type=Path, nargs="+", help="pool these calls' runs.jsonl instead of running")
    parser.add_argument("--new", type=Path, default=Path("."), help="the new tree (default: here)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10, help="ROUNDS for each run")
    parser.add_argument("--stages", default="bench steptables")
    parser.add_argument("--old-commit", default="old")
    parser.add_argument("--new-commit", default=None, help="default: the checkout's (CHUNKMETA_COMMIT)")
    parser.add_argument("--limit", type=float, default=1.05)
    args = parser.parse_args(argv)
    if args.pool:
        report(pool(args.pool, args.out, args.limit))
        return 0
    if args.old is None:
        parser.error("--old is needed unless --pool")
    share_carried(args.new, args.old)
    new_commit = args.new_commit or runs.checkout_commit()
    trees = {"new": (args.new.resolve(), new_commit), "old": (args.old.resolve(), args.old_commit)}
    stages = args.stages.split()
    scratch = Path(tempfile.mkdtemp())
    by_tree: dict[str, list[dict]] = {"new": [], "old": []}
    experiment = f"the old tree ({args.old_commit}) of an A/B against {new_commit}: not the current code"
    command = (
        f"python bench/diagnostics/ab_compare.py --pairs {args.pairs} --rounds {args.rounds} --stages '{args.stages}'"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {}
    runs_done = {"new": 0, "old": 0}
    for pair in range(args.pairs):
        for tree in ("new", "old") if pair % 2 == 0 else ("old", "new"):
            path, commit = trees[tree]
            env = {"CHUNKMETA_COMMIT": commit, "ROUNDS": str(args.rounds)}
            made = run_tree(path, stages, scratch / f"{tree}{pair}", env)
            for record in made if tree == "old" else ():
                record["experiment"] = experiment
            by_tree[tree] += made
            # written after every run: a call cut short by its time limit still returns its runs
            runs_done[tree] += 1
            complete = min(runs_done.values())  # a call cut short mid-pair counts the pairs it finished
            figures = {"pairs": complete, "rounds": args.rounds, "stages": stages, "old_commit": args.old_commit}
            figures.update(compare(by_tree, args.limit))
            ab = runs.make_record("gpu_ab", figures, command=command, commit=new_commit)
            every = by_tree["new"] + by_tree["old"] + ([ab] if figures["rows"] else [])
            runs.write_records(args.out / "runs.jsonl", every)
    report(figures)
    return 0 if figures["rows"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Two trees' chunkmeta builds in one process, interleaved: host p50 and device µs, new / old.

    python bench/diagnostics/ab_host.py --old DIR [--old-commit SHA] --out DIR [--rounds 20 (even)]
        [--calls 20] [--device cuda] [--workloads gpu_compare,step_tables]

Issue 33's guard compares an old and a new commit. Across processes (ab_compare.py here) the
host figures of identical code moved by more than the guard's 5% on an H100: step_tables'
floor's host p50 was +5.5 to +8.7% in the new tree's processes against the old's (gpu_compare's
-12 to +9%), and the floor's device µs fell in two modes, -9% (gpu_ab@2026-12-06T04:50:58Z).
Here both trees run in one process: the current tree as ``chunkmeta``, the old one beside it
as ``chunkmeta_ab_old`` (its package copied to a scratch directory, its own imports of
``chunkmeta`` renamed). Each build has a twin in the other tree on the same inputs; the twins run
in blocks of ``--calls`` back-to-back calls, in alternating order round by round (new old, old
new, ...), so that both see the same launch floor, allocator, caches and clocks. Their tables are
compared field by field, byte for byte, before and after.

The builds: per gpu_compare workload (one FLA table set, bench/gpu_compare.py) ``chunkmeta``
(``ChunkMetadataBuilder.build``), ``chunkmeta_oneshot`` (``build_chunk_metadata``) and, on CUDA,
``chunkmeta_graph`` (``GraphBuild.replay``); per step_tables workload (bench/step_tables.py)
``chunkmeta_kda_gdn``, ``chunkmeta_kda_gdn_vllm``, ``chunkmeta_mamba2`` and ``chunkmeta_hybrid``
(one ``StepTablesBuilder.build`` each). Each old tree must have those names (every commit since
the step builder has). Writes an ``ab_host`` record (``bench/results.py``) under ``--out``:
per build the medians over rounds of each tree's host p50, new / old, the device µs of each
(CUDA), and ``guard_met``: every ratio at most ``--limit``, every pair of tables equal.
"""

from __future__ import annotations

import argparse
import importlib
import numbers
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/: the benchmarks' modules
import results as runs
from gpu_compare import WORKLOADS as COMPARE_WORKLOADS
from gpu_compare import chunkmeta_methods, compare_workload
from step_tables import CAPACITY as STEP_CAPACITY
from step_tables import WORKLOADS as STEP_WORKLOADS
from step_tables import make_case, table_sets

import chunkmeta
from chunkmeta.timing import device_us_per_call, host_us, median

OLD_NAME = "chunkmeta_ab_old"
# the package's name where code names it: imports, sys.modules keys (``chunkmeta.fill...``), and
# the C extension's stem (``chunkmeta_native``): the extension is named by a hash of its sources,
# so two trees with the same C sources would otherwise share one module, and its static state
_PACKAGE_REF = re.compile(r"(?<![\w/])chunkmeta(?=\.[a-z_]|\s+import\b|_native\b)")


def load_tree(tree: Path, scratch: Path, name: str = OLD_NAME):
    """``tree``'s chunkmeta package, imported as ``name`` from a renamed copy in ``scratch``."""
    source = tree / "chunkmeta"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"{tree}: no chunkmeta package there")
    target = scratch / name
    shutil.copytree(source, target)
    for path in target.rglob("*.py"):
        path.write_text(_PACKAGE_REF.sub(name, path.read_text()))
    sys.path.insert(0, str(scratch))
    return importlib.import_module(name)


def fields(result) -> dict:
    """A build's result as plain values: its public fields (tensors as dtype, shape and bytes),
    and for a step's tables each table's, by name."""
    out = {}
    names = [a.name for a in getattr(type(result), "__attrs_attrs__", ())]
    names += [s for cls in type(result).__mro__ for s in getattr(cls, "__slots__", ())]
    for key in {*names, *getattr(result, "__dict__", {})}:
        if key.startswith("_") or key == "generation":
            continue
        value = getattr(result, key, None)
        if isinstance(value, torch.Tensor):
            out[key] = (value.dtype, tuple(value.shape), value.cpu().numpy().tobytes())
        elif value is None or isinstance(value, (bool, numbers.Number, str)):
            out[key] = value
        elif isinstance(value, tuple) and all(isinstance(v, (bool, numbers.Number, str)) for v in value):
            out[key] = value
    if hasattr(result, "names"):  # a step's tables (StepTables)
        out.update({f"table {name}": fields(result[name]) for name in result.names})
    return out


def same_tables(a, b) -> bool:
    """Whether two results hold the same fields with the same values, some of them tensors."""
    fa = fields(a)
    return fa == fields(b) and _has_tensor(fa)


def _has_tensor(values: dict) -> bool:
    return any(
        _has_tensor(v) if isinstance(v, dict) else isinstance(v, tuple) and isinstance(v[0], torch.dtype)
        for v in values.values()
    )


def compare_builds(pkg, device: str) -> list[tuple[str, str, object]]:
    """``(workload, build, call)`` of every build of one tree (``pkg``) on the shared inputs."""
    builds = []
    for num_seqs, num_tokens in COMPARE_WORKLOADS:
        key, batch = compare_workload(num_seqs, num_tokens)
        qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
        _, methods = chunkmeta_methods(pkg, qsl_cpu.to(device), qsl_cpu, num_seqs, num_tokens, 64, device)
        builds += [(key, name, call) for name, call in methods.items()]
    return builds


def step_builds(pkg, device: str) -> list[tuple[str, str, object]]:
    """``(workload, build, call)`` of every step_tables build of one tree (``pkg``), its tables
    made by its own modules."""
    sets = table_sets(
        importlib.import_module(f"{pkg.__name__}.replay"), importlib.import_module(f"{pkg.__name__}.tables")
    )
    builders = {
        f"chunkmeta_{name}": pkg.StepTablesBuilder(*STEP_CAPACITY, tables=specs, device=device)
        for name, specs in sets.items()
    }
    builds = []
    for decodes, prefills, tokens in STEP_WORKLOADS:
        qsl_cpu, computed_cpu = make_case(decodes, prefills, tokens, seed=decodes + prefills)
        qsl, computed = qsl_cpu.to(device), computed_cpu.to(device)
        positions = dict(num_computed_tokens=computed, num_computed_tokens_cpu=computed_cpu)
        for name, builder in builders.items():
            rows = positions if builder.needs_computed else {}
            builds.append(
                (
                    f"{decodes}+{prefills}x{tokens}",
                    name,
                    lambda b=builder, q=qsl, c=qsl_cpu, d=decodes, r=rows: b.build(q, c, first_seq=d, **r),
                )
            )
    return builds


def measure(pair: dict, rounds: int, calls: int, sync) -> dict:
    """Per tree, each round's host p50 of ``calls`` back-to-back calls (the first left out),
    the trees in alternating order round by round."""
    p50 = {tree: [] for tree in pair}
    order = list(pair)
    for k in range(rounds):
        for tree in order if k % 2 == 0 else order[::-1]:
            samples = [host_us(pair[tree]) for _ in range(calls + 1)][1:]
            p50[tree].append(median(samples))
            sync()
    return {tree: median(values) for tree, values in p50.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, type=Path, help="the old tree (a checkout or git archive)")
    parser.add_argument("--old-commit", default="unknown")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--limit", type=float, default=1.05)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default="gpu_compare,step_tables")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.rounds % 2:
        parser.error("--rounds: an even number, so that each tree goes first as often")
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    families = set(args.workloads.split(","))
    if families - {"gpu_compare", "step_tables"}:
        parser.error(f"--workloads: gpu_compare, step_tables, not {sorted(families)}")
    with tempfile.TemporaryDirectory() as scratch:
        old = load_tree(args.old.resolve(), Path(scratch))
        trees = {"new": chunkmeta, "old": old}
        made = {}
        for tree, pkg in trees.items():
            made[tree] = []
            if "gpu_compare" in families:
                made[tree] += compare_builds(pkg, args.device)
            if "step_tables" in families:
                made[tree] += step_builds(pkg, args.device)
        rows = []
        for (workload_key, build, new_call), (_, _, old_call) in zip(made["new"], made["old"], strict=True):
            pair = {"new": new_call, "old": old_call}
            for call in pair.values():  # compile, set up, warm
                call()
            sync()
            exact = same_tables(new_call(), old_call())
            host = measure(pair, args.rounds, args.calls, sync)
            exact &= same_tables(new_call(), old_call())
            row = {"workload": workload_key, "build": build, "exact": exact}
            row.update({f"host_p50_us_{tree}": host[tree] for tree in pair})
            row["host_ratio"] = host["new"] / host["old"]
            if cuda:
                device = {tree: [] for tree in pair}
                for k in range(4):
                    for tree in ("new", "old") if k % 2 == 0 else ("old", "new"):
                        device[tree].append(device_us_per_call(pair[tree], calls=100, lead_us=100 * 120, repeats=3))
                row.update({f"device_us_{tree}": median(values) for tree, values in device.items()})
                row["device_ratio"] = row["device_us_new"] / row["device_us_old"]
            rows.append(row)
            print(
                f"{workload_key} {build}: host {host['new']:.2f} / {host['old']:.2f} us ({row['host_ratio']:.3f})"
                + (f", device {row['device_ratio']:.3f}" if cuda else "")
                + ("" if exact else " TABLES DIFFER"),
                flush=True,
            )

    def ratio(row):  # a build's worse one: host, and device on CUDA
        return max(row["host_ratio"], row.get("device_ratio", 0))

    worst = max(rows, key=ratio)
    figures = {
        "old_commit": args.old_commit,
        "old_tree": str(args.old),
        "device_kind": args.device,
        "rounds": args.rounds,
        "calls": args.calls,
        "limit": args.limit,
        "rows": rows,
        "all_exact": all(r["exact"] for r in rows),
        "over_limit": [r for r in rows if ratio(r) > args.limit],
        "worst": {k: worst[k] for k in ("workload", "build", "host_ratio", "device_ratio") if k in worst},
        "host_median_ratio": median([r["host_ratio"] for r in rows]),
    }
    if cuda:
        figures["device_median_ratio"] = median([r["device_ratio"] for r in rows])
    figures["guard_met"] = figures["all_exact"] and not figures["over_limit"]
    runs.save(
        "ab_host",
        figures,
        script="bench/diagnostics/ab_host.py",
        argv=sys.argv[1:] if argv is None else argv,
        out=args.out,
    )
    return 0 if figures["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())

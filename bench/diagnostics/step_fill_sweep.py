"""The step fill's kernels swept on one GPU: device µs per build of a StepTablesBuilder whose C
build launches the Triton step kernel or the CUDA C step fill at each (THREADS, BLOCK_ROWS), for
the KDA/GDN step's tables and all five, at builder capacities 256, 1024 and 4096, on the
step_tables workloads that fit (and two larger ones at 4096). This is how the step builder's
kernel order and the CUDA fill's shape are chosen (``chunkmeta.step_builder._CUDA_STEP_FILL_FIRST_UP_TO``,
``CudaStepFill``).

    python bench/diagnostics/step_fill_sweep.py [--out DIR] [--repeats K] [--capacities 256,1024,4096]
        [--tables kda_gdn,all_five,mamba2] [--shapes 256/256,512/512]
        [--variants auto,spans_off,unpaired,old=.old/chunkmeta/csrc/step_fill.cu]

``--variants`` lists the CUDA fills measured at each shape: ``auto`` (the fill as the builder makes
it), ``spans_off`` (``SHARED_SPANS`` off: Mamba2 rows read their sequence's span from global
memory), ``unpaired`` (no entry's scan packs two rounds), and ``NAME=FILE``: another
``step_fill.cu`` with the same parameters (another commit's, an experiment) compiled with the
fill's defines and headers. Kernels of two trees compared in one process see the same launch
floor, which an A/B of two processes does not (issue 33's A/B: the floor is bimodal on an H100).

Every configuration is a builder of its own (its kernel compiled on its first build); each build
is checked against the reference once before and once after its timing, and the empty launch's
device µs is printed per workload (the floor every figure includes, which drifts). Each
configuration is measured twice, the second time in reverse order. Writes
``DIR/step_fill_sweep.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/: the benchmarks' modules
from anchors import empty_kernel
from step_tables import WORKLOADS, is_exact, make_case, table_sets

from chunkmeta import StepTablesBuilder, replay, step_builder
from chunkmeta import tables as T
from chunkmeta.fill import cuda_fill
from chunkmeta.timing import device_us_per_call

CAPACITIES = {256: 32768 + 256, 1024: 65536 + 1024, 4096: (1 << 20) + 4096}  # sequences: tokens
SHAPES = [(256, 256), (256, 512), (128, 256), (128, 128), (512, 512)]  # (THREADS, BLOCK_ROWS)
# past step_tables' workloads, for capacity 4096 (decodes, prefills, tokens)
LARGE = [(2048, 2048, 1 << 19), (0, 4096, 1 << 20)]


@contextlib.contextmanager
def forced(kernel: str, shape: tuple[int, int] | None, variant: str = "auto"):
    """Builders' C builds, set up inside (after a layout's first build), launch ``kernel``
    ("cuda" at ``shape`` as ``variant`` makes it, or "triton")."""
    plain, first_up_to = cuda_fill.CudaStepFill, step_builder._CUDA_STEP_FILL_FIRST_UP_TO
    chosen = {} if shape is None else dict(threads=shape[0], block_rows=shape[1])
    if variant == "spans_off":
        chosen["shared_spans"] = False
    if variant == "unpaired":
        chosen["row_capacities"] = ()  # no capacity known: no entry pairs its scan
    other = Path(variant.partition("=")[2]).read_text() if "=" in variant else None

    class Shaped(plain):
        def __init__(self, **kw):
            super().__init__(**{**kw, **chosen})
            if other is not None:  # kernels are cached per process by their defines: the file's hash
                self.defines += (("STEP_FILL_VARIANT", hashlib.sha256(other.encode()).hexdigest()[:16]),)

        def source(self, dtypes) -> bytes:
            text = super().source(dtypes)
            if other is None:
                return text
            return text[: text.index(cuda_fill.jit.source(cuda_fill.STEP_SOURCE).encode())] + other.encode()

    cuda_fill.CudaStepFill = Shaped  # step_builder imports it when it sets up a C build
    step_builder._CUDA_STEP_FILL_FIRST_UP_TO = 1 << 30 if kernel == "cuda" else 0
    try:
        yield
    finally:
        cuda_fill.CudaStepFill = plain
        step_builder._CUDA_STEP_FILL_FIRST_UP_TO = first_up_to


def parse_variant(value: str) -> str:
    if value in ("auto", "spans_off", "unpaired"):
        return value
    name, _, path = value.partition("=")
    if not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: auto, spans_off, unpaired or NAME=FILE (a step_fill.cu)")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--repeats", type=int, default=5, help="device measurements per figure (their median)")
    parser.add_argument(
        "--capacities", default=",".join(map(str, CAPACITIES)), help="builder capacities, from 256 1024 4096"
    )
    parser.add_argument("--tables", default="kda_gdn,all_five", help="table sets, from kda_gdn all_five mamba2")
    parser.add_argument("--shapes", default=",".join(f"{t}/{r}" for t, r in SHAPES), help="THREADS/BLOCK_ROWS")
    parser.add_argument("--variants", default="auto", help="the CUDA fills: auto spans_off unpaired NAME=FILE")
    args = parser.parse_args(argv)
    sets = table_sets(replay, T)
    known = {"kda_gdn": sets["kda_gdn"], "all_five": sets["hybrid"], "mamba2": sets["mamba2"]}
    unknown = set(args.tables.split(",")) - set(known)
    if unknown:
        parser.error(f"unknown --tables values {sorted(unknown)}")
    try:
        variants = [parse_variant(v) for v in args.variants.split(",")]
        shapes = [tuple(int(x) for x in shape.split("/")) for shape in args.shapes.split(",")]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    measured = {name: known[name] for name in args.tables.split(",")}
    configs = [("triton", None, "auto")] + [("cuda", s, v) for v in variants for s in shapes]
    rows = []
    for capacity in (int(c) for c in args.capacities.split(",")):
        for decodes, prefills, tokens in WORKLOADS + LARGE:
            if decodes + prefills > capacity or tokens > CAPACITIES[capacity] - capacity:
                continue
            qsl_cpu, computed_cpu = make_case(decodes, prefills, tokens, seed=decodes + prefills)
            case = (qsl_cpu, qsl_cpu.cuda(), computed_cpu, computed_cpu.cuda())
            floor_x = torch.empty(1, device="cuda")
            floor = device_us_per_call(lambda: empty_kernel[(1,)](floor_x), calls=100, lead_us=100 * 60, repeats=5)
            for set_name, tables in measured.items():
                made = []
                for kernel, shape, variant in configs:
                    if shape is not None and (shape[0] > max(capacity, 32) or shape[1] % shape[0]):
                        continue
                    builder = StepTablesBuilder(capacity, CAPACITIES[capacity], tables=tables, device="cuda")

                    positions = dict(num_computed_tokens=case[3], num_computed_tokens_cpu=case[2])

                    def build(b=builder, rows=positions if builder.needs_computed else {}):
                        return b.build(case[1], case[0], first_seq=decodes, **rows)

                    with forced(kernel, shape, variant):
                        exact = is_exact([builder], case, decodes)  # its first build: compiles, sets up
                        build()
                    ran = sorted(set(builder.c_build.values()) - {None})
                    made.append(
                        {
                            "kernel": kernel,
                            "shape": shape,
                            "variant": variant.partition("=")[0],
                            "ran": ran,
                            "exact": exact,
                            "build": build,
                            "builder": builder,
                            "us": [],
                        }
                    )
                for order in (made, made[::-1]):
                    for m in order:
                        m["us"].append(
                            device_us_per_call(m["build"], calls=100, lead_us=100 * 120, repeats=args.repeats)
                        )
                for m in made:
                    m["exact"] &= is_exact([m["builder"]], case, decodes)
                line = "  ".join(
                    f"{m['kernel']}{'' if m['shape'] is None else '{}/{}'.format(*m['shape'])}"
                    f"{'' if m['variant'] == 'auto' else ' ' + m['variant']}"
                    f"{'' if m['ran'] == [m['kernel']] else '(ran ' + ','.join(m['ran']) + ')'}"
                    f":{min(m['us']):.2f}{'' if m['exact'] else ' WRONG'}"
                    for m in sorted(made, key=lambda m: min(m["us"]))
                )
                print(
                    f"cap {capacity} {decodes}+{prefills}x{tokens} {set_name} (empty {floor:.2f}): {line}", flush=True
                )
                rows.append(
                    {
                        "capacity": capacity,
                        "decodes": decodes,
                        "prefills": prefills,
                        "tokens": tokens,
                        "tables": set_name,
                        "empty_launch_us": floor,
                        "configs": [
                            {
                                "kernel": m["kernel"],
                                "shape": m["shape"],
                                "variant": m["variant"],
                                "ran": m["ran"],
                                "exact": m["exact"],
                                "device_us": m["us"],
                            }
                            for m in made
                        ],
                    }
                )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_fill_sweep.json").write_text(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "nvrtc": cuda_fill.nvrtc_version(),
                "rows": rows,
            },
            indent=1,
        )
    )
    return 0 if all(c["exact"] for r in rows for c in r["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

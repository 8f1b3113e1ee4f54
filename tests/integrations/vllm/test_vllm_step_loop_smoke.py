"""``bench/vllm_step_loop.py --smoke`` on the real vLLM 0.33.0, CPU (`make test-vllm`; ~35 s).

One 16-token step of 3 decodes and a prefill through one Kimi-Linear KDA layer on vLLM's own
``causal_conv1d_fn`` (its CPU platform's torch version) and vendored ``chunk_kda_with_fused_gate``
under Triton's interpreter: vLLM's
metadata path and chunkmeta's both run, chunkmeta's tables reach the KDA op through the router, and
the outputs and states are bit-identical. Run as its own process: the smoke mode sets
``CUDA_VISIBLE_DEVICES=""`` and ``TRITON_INTERPRET=1`` before vLLM and triton are imported.

``.venv-vllm`` has no triton; the repo's ``.venv`` has one for the same torch, which this test puts
on the child's path alone (a directory holding links to its package and metadata only).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)


def triton_path(tmp_path) -> str | None:
    """'' if this Python has triton, a directory with only the repo's .venv triton, or None."""
    if importlib.util.find_spec("triton") is not None:
        return ""
    for package in sorted(ROOT.glob(".venv/lib/python*/site-packages/triton")):
        site = package.parent
        links = tmp_path / "triton_site"
        links.mkdir()
        for entry in [package, *site.glob("triton-*.dist-info")]:
            (links / entry.name).symlink_to(entry)
        return str(links)
    return None


def run_smoke(tmp_path, script: str, *args: str) -> dict:
    """``script --smoke *args`` in a child process with a triton on its path; its one record."""
    path = triton_path(tmp_path)
    if path is None:
        pytest.skip("no triton here or in the repo's .venv: vLLM's ops are Triton kernels")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    out = tmp_path / "out"
    command = [sys.executable, script, "--smoke", *args, "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = [json.loads(line) for line in next(out.glob("*.runs.jsonl")).read_text().splitlines()]
    return record


def test_smoke_runs_both_paths_and_they_agree(tmp_path):
    record = run_smoke(tmp_path, "bench/vllm_step_loop.py", "--concurrency", "4")
    (row,) = record["figures"]["rows"]
    assert row["vllm"]["available"] and row["chunkmeta"]["available"], row
    assert row["identical"] == {"warmup_output": True, "last_output": True, "states": True}
    assert row["finite_output"]
    assert row["router_hits_per_step"] > 0  # the KDA op took chunkmeta's tables, not its own derivation
    stats = row["chunkmeta_stats"]
    assert stats["fallbacks"] == 0 and stats["served"] == {"fla": stats["builds"], "conv": stats["builds"]}

"""Building the CUDA C step fill as a host program (tests/kernels/test_step_fill_host.py): the
C++ compiler, a build directory removed at exit, and one build per compiler, flags and inputs."""

import atexit
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SUPPORT = Path(__file__).parent  # step_host.cpp, cuda_host.h, step_host_main.h
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


def cxx() -> list[str]:
    """The C++ compiler command (``CXX`` split as a shell would, else g++ or clang++), or a skip."""
    words = shlex.split(os.environ.get("CXX", ""))
    if words:
        found = shutil.which(words[0])
        if found is None:
            pytest.skip(f"no C++ compiler: CXX={os.environ['CXX']!r} is not an executable on PATH")
        return [found, *words[1:]]
    found = shutil.which("g++") or shutil.which("clang++")
    if found is None:
        pytest.skip("no C++ compiler: CXX is unset and neither g++ nor clang++ is on PATH")
    return [found]


@functools.cache
def build_dir() -> Path:
    # removed at exit: each run's harnesses take ~20 MB, and CI's disk has run out before
    path = tempfile.mkdtemp(prefix="chunkmeta-cuda-host-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return Path(path)


def compile_harness(compiler: list[str], flags: list[str], inputs: list[Path]) -> Path:
    """A host harness program, built once per compiler, flags and input texts (under the
    sanitizers where the toolchain has their runtimes), or a skip without C++20's <barrier>."""
    key = hashlib.sha1(repr((compiler, flags, [path.read_bytes() for path in inputs])).encode()).hexdigest()[:16]
    binary = build_dir() / key
    done = subprocess.run([*compiler, *SANITIZE, *flags, "-o", str(binary)], capture_output=True, text=True)
    if done.returncode:  # a toolchain without the sanitizers' runtimes: plain, still checked
        done = subprocess.run([*compiler, *flags, "-o", str(binary)], capture_output=True, text=True)
    if done.returncode:
        if "barrier" in done.stderr and "No such file" in done.stderr:
            pytest.skip(f"{compiler[0]} has no C++20 <barrier>")
        raise AssertionError(done.stderr[-3000:])
    return binary

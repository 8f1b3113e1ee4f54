"""chunkmeta.jit on the host: compile on first use, cache by source hash, say why when it cannot.

The C compiler side runs for real (the host build, ``chunkmeta/csrc/host_build.c`` and its parts,
``chunkmeta.native.SOURCES``), with fake compilers (small shell scripts) for the failures. NVRTC
is not in the CPU venv, so its side runs against a fake NVRTC that answers through the same ctypes
calls; the real one compiles the kernel in tests/kernels/test_kernel_compiles.py where it is
installed.
"""

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from chunkmeta import jit, native, tables
from chunkmeta.fill import cuda_fill

NATIVE = dict(switch="CHUNKMETA_NATIVE", what="the compiled host build is off", libraries=("dl",))
CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """A fresh cache directory and a process that has not warned yet."""
    monkeypatch.setenv("CHUNKMETA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CHUNKMETA_NATIVE", raising=False)
    monkeypatch.delenv("CHUNKMETA_CUDA_FILL", raising=False)
    monkeypatch.setattr(jit, "_warned", set())
    monkeypatch.setattr(native, "_module", native._NOT_LOADED)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chunkmeta" and r.levelno == logging.WARNING]


def script(path, body: str):
    """An executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def needs_gcc() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc on PATH: the host build cannot be compiled here")
    return gcc


def built(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# -- the C compiler ---------------------------------------------------------------------------


def test_a_missing_compiler_warns_once_per_process(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native.module() is None
    monkeypatch.setattr(native, "_module", native._NOT_LOADED)
    assert native.module() is None  # tried again: still one warning
    (message,) = warnings_of(caplog)
    assert "no C compiler" in message and "'/nonexistent/cc'" in message
    assert "Set CHUNKMETA_NATIVE=0" in message


def test_no_compiler_on_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is None
    (message,) = warnings_of(caplog)
    assert "CC is unset and none of cc, gcc, clang is on PATH" in message


def test_a_failing_compiler_reports_the_first_lines_of_its_stderr(monkeypatch, tmp_path, caplog):
    cc = script(
        tmp_path / "cc",
        """\
        for i in 1 2 3 4 5 6 7 8 9; do echo "host_build.c:$i: error: number $i" >&2; done
        exit 3
    """,
    )
    monkeypatch.setenv("CC", str(cc))
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is None
    (message,) = warnings_of(caplog)
    assert f"{cc} failed on host_build.c (exit 3)" in message
    assert "host_build.c:1: error: number 1" in message and "number 6" in message and "number 7" not in message
    assert built(tmp_path / "cache") == []  # nothing left behind, not even the temporary directory


@pytest.mark.parametrize(
    "fail_when, stderr, named",
    [
        ("host_step.c", "host_step.c:7: error: broken", "host_step.c"),
        ("-shared", "ld: undefined reference to int_args", "the link of " + ", ".join(native.SOURCES)),
    ],
)
def test_the_failing_compile_or_link_is_named(monkeypatch, tmp_path, caplog, fail_when, stderr, named):
    """Each source compiles alone, then the objects link: the message names the step that failed
    (one part, not the module's file; or the link). The fake compiler fails on a command line
    containing ``fail_when`` and makes an empty file at the ``-o`` path of any other."""
    cc = script(
        tmp_path / "cc",
        f"""\
        out=""; prev=""
        for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
        case "$*" in *{fail_when}*) echo "{stderr}" >&2; exit 1;; esac
        touch "$out"
    """,
    )
    monkeypatch.setenv("CC", str(cc))
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is None
    (message,) = warnings_of(caplog)
    assert f"{cc} failed on {named} (exit 1): {stderr}" in message
    assert built(tmp_path / "cache") == []


def test_no_python_headers(monkeypatch, tmp_path, caplog):
    needs_gcc()
    monkeypatch.setattr(jit.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is None
    (message,) = warnings_of(caplog)
    assert f"no Python headers: {tmp_path}/Python.h is missing" in message


def test_an_unwritable_cache_directory(monkeypatch, tmp_path, caplog):
    needs_gcc()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CHUNKMETA_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is None
    (message,) = warnings_of(caplog)
    assert "cannot write the compiled extension" in message and "CHUNKMETA_CACHE_DIR" in message


def test_a_package_installed_without_its_sources(monkeypatch, tmp_path, caplog):
    needs_gcc()
    monkeypatch.setattr(jit, "CSRC", tmp_path / "csrc")
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is None
    (message,) = warnings_of(caplog)
    assert f"cannot read chunkmeta's source {tmp_path}/csrc/host_build.c" in message


def test_the_switch_turns_the_attempt_and_the_warning_off(monkeypatch, tmp_path, caplog):
    ran = tmp_path / "ran"
    monkeypatch.setenv("CC", str(script(tmp_path / "cc", f"touch {ran}\nexit 1\n")))
    monkeypatch.setenv("CHUNKMETA_NATIVE", "0")
    assert native.module() is None
    assert not ran.exists() and warnings_of(caplog) == []
    monkeypatch.setenv("CHUNKMETA_NATIVE", "1")  # the same compiler, switched on: it runs, and warns
    monkeypatch.setattr(native, "_module", native._NOT_LOADED)
    assert native.module() is None
    assert ran.exists() and len(warnings_of(caplog)) == 1


def test_a_cache_hit_compiles_nothing(monkeypatch, tmp_path, caplog):
    """The second process loads the first one's build: the compiler does not run again."""
    gcc = needs_gcc()
    calls = tmp_path / "calls"
    monkeypatch.setenv("CC", str(script(tmp_path / "cc", f'echo run >> {calls}\nexec {gcc} "$@"\n')))
    assert native.module() is not None and native.module().plan is not None
    runs = len(native.SOURCES) + 1  # a compile per source, then the link
    assert calls.read_text().count("run") == runs
    (extension,) = built(tmp_path / "cache")
    assert extension.startswith("chunkmeta_native_")
    load = "from chunkmeta import native; assert native.module() is not None"
    subprocess.run([sys.executable, "-c", load], check=True, env=os.environ.copy(), timeout=120)
    assert calls.read_text().count("run") == runs
    assert built(tmp_path / "cache") == [extension] and warnings_of(caplog) == []


def test_a_changed_header_or_part_builds_again(monkeypatch, tmp_path):
    """The extension's cache key covers the headers its sources include (step_chunks.h, which
    the CUDA step fill shares) and every source, not only the module's: an edit there is a new
    build, never a stale one."""
    needs_gcc()
    csrc = tmp_path / "csrc"
    shutil.copytree(jit.CSRC, csrc)
    monkeypatch.setattr(jit, "CSRC", csrc)
    assert native.module() is not None
    (first,) = built(tmp_path / "cache")
    for edited in ("step_chunks.h", native.SOURCES[-1]):
        with open(csrc / edited, "a") as text:
            text.write("/* edited */\n")
        monkeypatch.setattr(native, "_module", native._NOT_LOADED)
        assert native.module() is not None
    assert len(built(tmp_path / "cache")) == 3 and first in built(tmp_path / "cache")


def test_only_the_module_init_is_exported(tmp_path):
    """The sources share functions across files, compiled hidden: the extension exports PyInit_
    alone, so a library loaded before it with a symbol of the same name (int_args, launch_kernel)
    cannot take its calls."""
    needs_gcc()
    loaded = native.module()
    assert loaded is not None
    library = ctypes.CDLL(loaded.__file__)
    assert getattr(library, f"PyInit_{loaded.__name__}") is not None
    for name in ("int_args", "plan_any", "launch_kernel", "new_object", "plain_tensor", "py_step"):
        assert not hasattr(library, name), name


def test_a_compiler_command_with_words(monkeypatch, tmp_path):
    """CC is split as a shell would: a launcher before the compiler (``ccache gcc``), flags after
    it (``gcc -std=gnu11``). Each command is its own build in the cache."""
    needs_gcc()
    calls = tmp_path / "calls"
    launcher = script(tmp_path / "fake ccache", f'echo "$1" >> {calls}\nexec "$@"\n')  # a space in its path
    monkeypatch.setenv("CC", f"'{launcher}' gcc")
    assert jit.extension("chunkmeta_native", native.SOURCES, **NATIVE) is not None
    assert calls.read_text().split() == ["gcc"] * (len(native.SOURCES) + 1)
    monkeypatch.setenv("CC", "gcc -std=gnu11")
    loaded = jit.extension("chunkmeta_native", native.SOURCES, **NATIVE)
    assert loaded is not None and loaded.plan is not None
    assert len(built(tmp_path / "cache")) == 2


def test_concurrent_first_builds(tmp_path):
    """Processes that find no build at the same time each compile and rename theirs into place:
    every one loads a whole extension, and one file is left."""
    needs_gcc()
    load = "from chunkmeta import native; m = native.module(); assert m is not None and m.plan(0, 0, 0, 6)[0] == 0"
    procs = [
        subprocess.Popen([sys.executable, "-c", load], env=os.environ.copy(), stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert len(built(tmp_path / "cache")) == 1


# -- NVRTC ------------------------------------------------------------------------------------


class FakeNVRTC:
    """NVRTC's C API as ctypes calls it: compiles to ``b"CUBIN" + source`` or fails with ``log``."""

    def __init__(self, log: str | None = None):
        self.log = log
        self.version = (13, 0)
        self.compiles = 0
        self.headers = []

    def nvrtcVersion(self, major, minor):
        major._obj.value, minor._obj.value = self.version
        return 0

    def nvrtcCreateProgram(self, program, source, name, count, texts, names):
        self.source = source
        self.headers = [(names[i], texts[i]) for i in range(count)]
        return 0

    def nvrtcCompileProgram(self, program, count, options):
        self.compiles += 1
        self.options = [options[i] for i in range(count)]
        return 0 if self.log is None else 6

    def nvrtcGetProgramLogSize(self, program, size):
        size._obj.value = len(self.log) + 1
        return 0

    def nvrtcGetProgramLog(self, program, buffer):
        buffer.value = self.log.encode()
        return 0

    def nvrtcGetCUBINSize(self, program, size):
        size._obj.value = len(b"CUBIN" + self.source)
        return 0

    def nvrtcGetCUBIN(self, program, buffer):
        ctypes.memmove(buffer, b"CUBIN" + self.source, len(b"CUBIN" + self.source))
        return 0

    def nvrtcDestroyProgram(self, program):
        return 0


I32 = (torch.int32,) * 3  # the step fill's input dtypes


def fla_fill(chunk_size: int, block_seqs: int, padded: bool) -> cuda_fill.CudaStepFill:
    """The CUDA C step fill of one FLA table (ChunkMetadataBuilder's)."""
    entries = tables.slot_layout({"fla": tables.Fla(chunk_size)}, block_seqs, 4096, "tail").entries
    return cuda_fill.CudaStepFill(entries=entries, block_seqs=block_seqs, padded=padded)


@pytest.fixture
def on_a_gpu(monkeypatch):
    """CudaStepFill.kernel as on a GPU, up to the load (which needs a driver)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cuda_fill, "_modules", {})
    loads = []
    monkeypatch.setattr(cuda_fill, "load_function", lambda image, device, entry: loads.append(image) or 1234)
    return loads


def test_no_nvrtc_warns_once(monkeypatch, on_a_gpu, caplog):
    monkeypatch.setattr(jit, "_libs", {})
    monkeypatch.setattr(jit, "_nvrtc_candidates", lambda: ["/nonexistent/libnvrtc.so.13"])
    assert jit.nvrtc_version() is None
    for block_seqs in (64, 128):  # two shapes, one warning
        assert fla_fill(64, block_seqs, False).kernel(I32, CUDA0) is None
    (message,) = warnings_of(caplog)
    assert "the CUDA C fill is off" in message and "no NVRTC" in message and "/nonexistent/libnvrtc.so.13" in message
    assert "Set CHUNKMETA_CUDA_FILL=0" in message
    assert on_a_gpu == []


def test_nvrtc_failing_reports_the_first_lines_of_its_log(monkeypatch, on_a_gpu, caplog):
    log = "\n".join(f'step_tables_fill.cu({i}): error: identifier "x{i}" is undefined' for i in range(1, 10))
    monkeypatch.setattr(jit, "_libs", {"nvrtc": FakeNVRTC(log)})
    assert fla_fill(64, 64, True).kernel((torch.int64,) * 3, CUDA0) is None
    (message,) = warnings_of(caplog)
    assert "NVRTC failed on step_tables_fill.cu (error 6)" in message
    assert '"x1"' in message and '"x6"' in message and '"x7"' not in message


def test_the_cuda_fill_switch_turns_the_attempt_and_the_warning_off(monkeypatch, on_a_gpu, caplog):
    fake = FakeNVRTC("error")
    monkeypatch.setattr(jit, "_libs", {"nvrtc": fake})
    monkeypatch.setenv("CHUNKMETA_CUDA_FILL", "0")
    assert fla_fill(64, 64, False).kernel(I32, CUDA0) is None
    assert fake.compiles == 0 and warnings_of(caplog) == []


def test_the_kernel_gets_its_source_and_header_and_the_cubin_is_cached(monkeypatch, tmp_path, on_a_gpu, caplog):
    fake = FakeNVRTC()
    monkeypatch.setattr(jit, "_libs", {"nvrtc": fake})
    fill = fla_fill(64, 64, False)
    assert fill.kernel(I32, CUDA0) == (1234, 2, 0)
    assert fake.headers == [
        (name.encode(), (jit.CSRC / name).read_bytes()) for name in ("step_chunks.h", "row_search.h")
    ]
    assert fake.source.endswith((jit.CSRC / "step_fill.cu").read_bytes())
    assert b"#define QSL_T int\n" in fake.source and b"#define PADDED 0\n" in fake.source
    assert fake.options == [b"--gpu-architecture=sm_90", b"-default-device"]
    assert on_a_gpu == [b"CUBIN" + fake.source]
    (cubin,) = built(tmp_path / "cache")
    assert cubin.startswith("step_tables_fill_") and cubin.endswith(".cubin")
    # a new process (a fresh kernel table): the cubin from the cache, NVRTC not run again
    monkeypatch.setattr(cuda_fill, "_modules", {})
    assert fill.kernel(I32, CUDA0) == (1234, 2, 0)
    assert fake.compiles == 1 and on_a_gpu[1] == on_a_gpu[0]
    # another shape or another NVRTC: another cubin
    fla_fill(32, 64, False).kernel(I32, CUDA0)
    fake.version = (13, 1)
    monkeypatch.setattr(cuda_fill, "_modules", {})
    fill.kernel(I32, CUDA0)
    assert fake.compiles == 3 and len(built(tmp_path / "cache")) == 3
    assert warnings_of(caplog) == []

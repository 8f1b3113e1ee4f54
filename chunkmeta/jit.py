"""Compile chunkmeta's sources (``chunkmeta/csrc``) on first use, cache them, say why when it cannot.

Two compilers, one cache:

* ``extension(stem, sources, switch=...)``: a CPython extension from ``.c`` files of ``csrc``,
  built by the C compiler (``$CC``, split as a shell would, so ``CC="ccache gcc"`` and
  ``CC="gcc -std=gnu11"`` work; else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``): each
  file compiled alone (a failure names its file), then the objects linked into one extension,
  loaded with importlib. Its module name carries the cache key (``-DMODULE_NAME=...``).
* ``cubin(source, capability, headers)``: a CUDA source compiled by NVRTC (through ctypes; the
  ``nvidia-cuda-nvrtc`` wheel torch's CUDA builds depend on, or a CUDA toolkit) for ``sm_XY``.

Both are cached in ``$CHUNKMETA_CACHE_DIR`` (default ``~/.cache/chunkmeta``) under a hash of
everything that shapes the output: the sources and headers, the defines and flags, the compiler
command (``CC`` and the file it resolves to) or the NVRTC version, the Python version and the
platform. Files are written to a temporary name in that directory and renamed into place, so
concurrent processes never load a half-written file.

When a compile cannot happen (no C compiler, no Python headers, the compiler failed, no NVRTC,
NVRTC failed) the caller falls back to a slower path, and ``unavailable`` logs one warning per
process and job through ``logging.getLogger("chunkmeta")``: what is off, why, and the variable
that turns the job off (``CHUNKMETA_NATIVE=0``, ``CHUNKMETA_CUDA_FILL=0``); a job turned off is
not attempted and does not warn.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
log = logging.getLogger("chunkmeta")
_warned: set[str] = set()  # the switches whose job has warned in this process


class Unavailable(RuntimeError):
    """A compile that cannot be done here; the message says why."""


def enabled(switch: str) -> bool:
    """Whether the job that ``switch`` (an environment variable) turns off with ``0`` is on."""
    return os.environ.get(switch, "1") != "0"


def unavailable(switch: str, what: str, why: str) -> None:
    """Warn, once per process for ``switch``, that ``what`` is off and why."""
    if switch in _warned:
        return
    _warned.add(switch)
    log.warning("chunkmeta: %s: %s. Set %s=0 to turn it off without this warning.", what, why, switch)


def cache_dir() -> Path:
    return Path(os.environ.get("CHUNKMETA_CACHE_DIR") or Path.home() / ".cache" / "chunkmeta")


def source(name: str) -> str:
    """The text of ``chunkmeta/csrc/<name>``; Unavailable if the package was installed without it."""
    try:
        return (CSRC / name).read_text()
    except OSError as exc:
        raise Unavailable(f"cannot read chunkmeta's source {CSRC / name} ({exc})") from None


def _key(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _first_lines(text: str, count: int = 6) -> str:
    lines = [line.rstrip()[:300] for line in text.splitlines() if line.strip()]
    return " | ".join(lines[:count]) + (" | ..." if len(lines) > count else "")


def _write_atomically(target: Path, write) -> None:
    """``write(path)`` makes the file at a temporary path beside ``target``, then it is renamed to
    ``target`` (atomic on one filesystem: readers see the old file, the whole new one, or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built = Path(tmp) / target.name
        write(built)
        os.replace(built, target)


# -- the C compiler: CPython extensions ------------------------------------------------------


def c_compiler() -> list[str]:
    """The C compiler command, its first word resolved on ``PATH``; Unavailable if there is none."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        try:
            words = shlex.split(cc)
        except ValueError as exc:
            raise Unavailable(f"no C compiler: CC={cc!r} does not split into words ({exc})") from None
        found = shutil.which(words[0])
        if found is None:
            raise Unavailable(f"no C compiler: CC={cc!r}, and {words[0]!r} is not an executable on PATH")
        return [found, *words[1:]]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise Unavailable("no C compiler: CC is unset and none of cc, gcc, clang is on PATH")


def python_include() -> str:
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise Unavailable(
            f"no Python headers: {include}/Python.h is missing (install this Python's development "
            "headers, e.g. the python3-dev package)"
        )
    return include


def missing_c_toolchain() -> str | None:
    """Why no extension can be compiled here (no C compiler, no Python headers), or None."""
    try:
        c_compiler()
        python_include()
    except Unavailable as exc:
        return str(exc)
    return None


def extension(stem: str, sources: str | tuple[str, ...], *, switch: str, what: str, libraries: tuple[str, ...] = ()):
    """The extension compiled from ``csrc/<sources>`` (one file name, or several: each is compiled
    alone, then the objects are linked into one), loaded; None (after ``unavailable``'s warning)
    when it cannot be had, or at once when ``switch`` is ``0``."""
    if not enabled(switch):
        return None
    try:
        return _load_extension(stem, (sources,) if isinstance(sources, str) else tuple(sources), libraries)
    except Unavailable as exc:
        unavailable(switch, what, str(exc))
        return None


def _run_compiler(compiler: list[str], command: list[str], label: str) -> None:
    """Run one compiler ``command``; Unavailable, naming ``label`` (what it compiles), when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"the C compiler {shlex.join(compiler)!r} did not run: {exc}") from None
    if done.returncode:
        raise Unavailable(
            f"{shlex.join(compiler)} failed on {label} (exit {done.returncode}): "
            f"{_first_lines(done.stderr) or '(no message)'}"
        )


def _load_extension(stem: str, source_names: tuple[str, ...], libraries: tuple[str, ...]):
    compiler = c_compiler()
    include = python_include()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    # hidden: what the sources share across files is not exported (PyInit_ is: PyMODINIT_FUNC),
    # so no library loaded before with a symbol of the same name can take a call meant for ours
    flags = ["-O3", "-fPIC", "-fvisibility=hidden", f"-I{include}"]
    name = (
        stem
        + "_"
        + _key(
            [(source_name, source(source_name)) for source_name in source_names],
            [source(header.name) for header in sorted(CSRC.glob("*.h"))],  # what they may include
            compiler,
            os.path.realpath(compiler[0]),
            flags,
            libraries,
            sys.version,
            sys.platform,
            platform.machine(),
            suffix,
        )
    )
    target = cache_dir() / f"{name}{suffix}"
    if not target.exists():

        def build(out: Path) -> None:
            objects = []
            for source_name in source_names:  # beside ``out``, in its temporary directory
                objects.append(str(out.parent / f"{Path(source_name).stem}.o"))
                command = [*compiler, *flags, f"-DMODULE_NAME={name}", "-c", str(CSRC / source_name), "-o", objects[-1]]
                _run_compiler(compiler, command, source_name)
            link = [*compiler, "-shared", *objects, "-o", str(out), *(f"-l{lib}" for lib in libraries)]
            _run_compiler(compiler, link, f"the link of {', '.join(source_names)}")

        try:
            _write_atomically(target, build)
        except OSError as exc:  # the cache directory cannot be made or written
            raise Unavailable(
                f"cannot write the compiled extension to {target.parent} ({exc}); "
                "point CHUNKMETA_CACHE_DIR at a writable directory"
            ) from None
    spec = importlib.util.spec_from_file_location(name, target)
    loaded = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(loaded)
    except ImportError as exc:
        raise Unavailable(f"{target} did not load: {exc}") from None
    return loaded


# -- NVRTC: CUDA sources to cubins ----------------------------------------------------------

_libs: dict[str, ctypes.CDLL] = {}


def _nvrtc_candidates() -> list[str]:
    """NVRTC libraries to try, those of torch's CUDA major version first (a cubin from a newer
    NVRTC may not load on the driver torch runs on)."""
    import torch

    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    found = []
    for root in sys.path:  # the nvidia-cuda-nvrtc wheels: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    found = [p for p in found if "builtins" not in p and "alt" not in os.path.basename(p)] + names
    major = (torch.version.cuda or "").split(".")[0]
    return sorted(found, key=lambda p: not (major and (p.endswith(f".so.{major}") or f"/cu{major}/" in p)))


def _nvrtc() -> ctypes.CDLL:
    if "nvrtc" not in _libs:
        errors = []
        for candidate in _nvrtc_candidates():
            try:
                # NVRTC opens its builtins library by name at compile time; a wheel's copy sits
                # next to it but off the loader's path, so load it first (where there is one)
                directory = os.path.dirname(candidate)
                beside = glob.glob(os.path.join(directory, "libnvrtc-builtins.so*")) if directory else []
                for builtins in sorted(beside):
                    try:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    except OSError:  # NVRTC may still find one on the loader's path
                        pass
                _libs["nvrtc"] = ctypes.CDLL(candidate)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise Unavailable("no NVRTC (pip install nvidia-cuda-nvrtc, or a CUDA toolkit): " + "; ".join(errors[-2:]))
    return _libs["nvrtc"]


def check(result: int, what: str) -> None:
    """Raise RuntimeError for a failed CUDA or NVRTC call (a nonzero result)."""
    if result != 0:
        raise RuntimeError(f"{what} failed with error {result}")


def nvrtc_version() -> str | None:
    """The NVRTC this process would compile with ("13.0"), or None without one."""
    try:
        major, minor = ctypes.c_int(), ctypes.c_int()
        check(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    except RuntimeError:  # Unavailable included
        return None
    return f"{major.value}.{minor.value}"


def cubin(
    source_text: bytes, capability: tuple[int, int], headers: dict[str, str], program: str = "chunk_metadata_fill.cu"
) -> bytes:
    """``source_text`` compiled by NVRTC for ``capability`` (sm_XY), with ``headers`` (include
    name -> text) as its in-memory headers: from the cache when this NVRTC compiled the same
    before. Unavailable without NVRTC or when it fails (the message holds its log's first lines)."""
    options = [f"--gpu-architecture=sm_{capability[0]}{capability[1]}", "-default-device"]
    key = _key(source_text, sorted(headers.items()), options, program, nvrtc_version())
    target = cache_dir() / f"{Path(program).stem}_{key}.cubin"
    try:
        return target.read_bytes()
    except OSError:
        pass
    image = _nvrtc_compile(source_text, options, headers, program)
    try:
        _write_atomically(target, lambda out: out.write_bytes(image))
    except OSError:  # a cache that cannot be written costs a compile per process, nothing else
        log.debug("chunkmeta: could not cache %s", target, exc_info=True)
    return image


def _nvrtc_compile(source_text: bytes, options: list[str], headers: dict[str, str], program_name: str) -> bytes:
    nvrtc = _nvrtc()
    program = ctypes.c_void_p()
    names = (ctypes.c_char_p * max(len(headers), 1))(*[name.encode() for name in headers])
    texts = (ctypes.c_char_p * max(len(headers), 1))(*[text.encode() for text in headers.values()])
    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), source_text, program_name.encode(), len(headers), texts, names),
        "nvrtcCreateProgram",
    )
    try:
        array = (ctypes.c_char_p * len(options))(*[option.encode() for option in options])
        result = nvrtc.nvrtcCompileProgram(program, len(options), array)
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log_text = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log_text)
            raise Unavailable(
                f"NVRTC failed on {program_name} (error {result}): "
                f"{_first_lines(log_text.value.decode(errors='replace')) or '(no log)'}"
            )
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        image = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, image), "nvrtcGetCUBIN")
        return image.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))

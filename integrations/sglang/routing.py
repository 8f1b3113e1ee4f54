"""How a forward's tables reach SGLang's kernels, keyed by the backend's own ``query_start_loc``.

* KDA, SGLang >= 0.5.22 on CUDA: ``chunk_indices=`` / ``chunk_offsets=`` are added to the
  backend's ``kernel_dispatcher.extend(...)`` call (its Triton kernel,
  ``srt/layers/attention/linear/kernels/kda_triton.py``, forwards them to ``chunk_kda``).
* GDN, KDA before 0.5.22, and KDA on ROCm: the ``FlaRouter`` over SGLang's vendored FLA package
  (``kernels/ops/attention/fla``, ``srt/layers/attention/fla`` before 0.5.16) answers its
  ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` calls. On ROCm an injected
  ``chunk_indices`` would switch off SGLang's gfx950 KDA prefill kernel, which it takes only when
  none is passed.

Both key on the identity of the backend's ``query_start_loc`` tensor, so tables never reach a
kernel of another forward, of another backend, or of SGLang's own KDA prefill-graph path (which
passes tables of its own).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import weakref

# Where SGLang vendors FLA, newest layout first (moved to kernels/ in 0.5.16).
FLA_PACKAGES = ("kernels.ops.attention.fla", "srt.layers.attention.fla")


def find_fla(package: str) -> str | None:
    """The vendored FLA package inside SGLang package ``package``, or None. One SGLang has
    imported already is found without importing anything (``find_spec`` of a submodule imports
    its parent packages)."""
    names = [f"{package}.{relative}" for relative in FLA_PACKAGES]
    for name in names:
        if sys.modules.get(name + ".index") is not None:
            return name
    for name in names:
        try:
            if importlib.util.find_spec(name + ".index") is not None:
                return name
        except ModuleNotFoundError:
            continue
    return None


def chunk_kda_takes_tables(fla_package: str | None) -> bool:
    """The vendored ``chunk_kda`` accepts ``chunk_indices`` and ``chunk_offsets`` (SGLang >= 0.5.22)."""
    if not fla_package or importlib.util.find_spec(f"{fla_package}.kda") is None:
        return False
    chunk_kda = getattr(importlib.import_module(f"{fla_package}.kda"), "chunk_kda", None)
    if chunk_kda is None:
        return False
    parameters = inspect.signature(chunk_kda).parameters
    return "chunk_indices" in parameters and "chunk_offsets" in parameters


def add_tables_to_dispatcher(backend) -> None:
    """Wrap this backend's ``kernel_dispatcher.extend`` (an instance attribute: this backend's
    dispatcher only) so that its calls carry the forward's tables (``add_table_kwargs``)."""
    dispatcher = getattr(backend, "kernel_dispatcher", None)
    if dispatcher is None or not callable(getattr(dispatcher, "extend", None)):
        return
    original = dispatcher.extend
    chunks = backend.chunkmeta

    def extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
        chunks.add_table_kwargs(query_start_loc, kwargs)
        return original(
            q,
            k,
            v,
            g,
            beta,
            ssm_states=ssm_states,
            cache_indices=cache_indices,
            query_start_loc=query_start_loc,
            **kwargs,
        )

    dispatcher.extend = extend


class Provider:
    """Serves one chunk size of a backend's current tables to the router (the service side
    ``FlaRouter`` reads: ``in_step`` and ``current``). Holds the backend's state weakly, so a
    dropped backend answers nothing and frees its buffers."""

    __slots__ = ("_chunks", "chunk_size")

    def __init__(self, chunks, chunk_size: int):
        self._chunks = weakref.ref(chunks)
        self.chunk_size = chunk_size

    @property
    def in_step(self) -> bool:
        chunks = self._chunks()
        return chunks is not None and self.chunk_size in chunks.served

    @property
    def current(self):
        return self._chunks().served[self.chunk_size]

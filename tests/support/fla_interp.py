"""Test support: run flash-linear-attention's real KDA/GDN forward kernels on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, set by the root conftest before triton is imported).

Written for fla-core 0.6.0 and triton 3.9.0 (interpreter), forward passes in float32 (the
interpreter's bf16 ``tl.dot`` is not faithful). Three narrow, reversible patches, each applied only
when the problem it fixes is present:

* ``autotune`` — Triton's Autotuner benchmarks its configs even under the interpreter, which
  needs a GPU driver (``RuntimeError: 0 active drivers``). Keep the first config only: with one
  config the autotuner skips benchmarking.
* ``loop_var`` — compiled Triton gives ``range`` loops a tensor induction variable; the
  interpreter a Python int, so FLA's ``i_t.to(tl.int64)`` (``fla/ops/common/chunk_delta_h.py``)
  raises. Rewrite ``for i in range(...)`` bodies to start with ``i = i``, which the interpreter's
  own assignment rewrite turns into a scalar tensor.
* ``aliases`` — a module-level alias of a ``triton.language`` builtin (FLA's ``gather = tl.gather``,
  ``fla/ops/utils/op.py``; vLLM's vendored copy also aliases ``exp``, ``exp2``, ``log``, ...) is not
  swapped for the interpreter's version during a launch; rebind each to a late lookup.

``apply()`` does this for fla-core, ``apply_vllm()`` for vLLM 0.33.0's vendored FLA / KDA ops and
its ``causal_conv1d`` (vLLM also needs ``CUDA_VISIBLE_DEVICES=""`` before it is imported: without
an active GPU driver its ``triton_utils`` disables Triton unless that variable is set and empty).

FLA's ``device='cuda'`` fallback on machines without a GPU needs no fix (only no-op contexts see
it).
"""

from __future__ import annotations

import ast
import os
import sys
import warnings

_PATCHES: list[tuple[object, str, object]] = []
_MISSING = object()


def _set(owner, attr, value):
    original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
    _PATCHES.append((owner, attr, original))
    setattr(owner, attr, value)


def _fix_autotune():
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def first_config_only(self, kwargs):
        return list(prune(self, kwargs))[:1]

    _set(Autotuner, "prune_configs", first_config_only)


def _fix_loop_var():
    from triton.runtime import interpreter

    if "visit_For" in interpreter.ASTTransformer.__dict__:
        return  # this triton's interpreter already rewrites loops

    def is_range(node):
        return isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == "range")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "range")
        )

    def visit_For(self, node):
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name) and is_range(node.iter):
            name = node.target.id
            assign = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load()))
            node.body.insert(0, self.visit_Assign(assign))
        return node

    _set(interpreter.ASTTransformer, "visit_For", visit_For)
    interpreter.InterpretedFunction.rewritten_fn.clear()


def _late(name):
    def builtin(*args, **kwargs):
        import triton.language as tl

        # the interpreter swaps tl's attributes for its own versions only while a launch runs
        return getattr(tl, name)(*args, **kwargs)

    builtin.__name__ = name
    return builtin


def _fix_aliases(package: str):
    import triton.language as tl

    builtins = {id(value): name for name, value in vars(tl).items() if getattr(value, "__triton_builtin__", False)}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if not attr.startswith("__") and id(value) in builtins:
                _set(module, attr, _late(builtins[id(value)]))


_APPLIED: set[str] = set()


def _apply(package: str, load) -> None:
    if package in _APPLIED:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform, roll back to CPU"
        load()
    if not _APPLIED:
        _fix_autotune()
        _fix_loop_var()
    _fix_aliases(package)
    _APPLIED.add(package)


def apply() -> None:
    """Import FLA's KDA/GDN and patch them for the interpreter. Idempotent."""

    def load():
        import fla.ops.gated_delta_rule
        import fla.ops.kda
        import fla.ops.kda.chunk_intra  # noqa: F401

    _apply("fla", load)


def apply_vllm() -> None:
    """Import vLLM's vendored FLA / KDA ops (Kimi-Linear's, NVIDIA's copy) and ``causal_conv1d``,
    and patch them for the interpreter. Idempotent."""

    def load():
        import vllm.model_executor.layers.mamba.ops.causal_conv1d
        import vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk
        import vllm.third_party.flash_linear_attention.ops.kda  # noqa: F401

    _apply("vllm", load)


def revert() -> None:
    _APPLIED.clear()
    while _PATCHES:
        owner, attr, original = _PATCHES.pop()
        if original is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)

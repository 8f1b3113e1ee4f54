"""What an engine's own plugin loading imports, in a fresh interpreter, with chunkmeta opted in or not.

Engines load their plugins in every process they start (vLLM's API server, engine core and workers;
SGLang's engine, detokenizer and schedulers), most of which never run a model. chunkmeta's plugins
must import nothing of the engine there: their patches wait for the engine's own import of each
target module. ``plugin_imports`` runs the engine's loader in a new interpreter (this one's python:
the engine venv's under ``make test-vllm`` / ``make test-sglang``) and returns the engine modules
that appeared during the loader's call; the caller compares a run with the opt-in set against one
without it, which is everything the loader (and chunkmeta's entry-point module) imports anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_MARK = "CHUNKMETA_ENGINE_IMPORTS "

_SCRIPT = """
import json
import sys

{prelude}


def engine():
    return {{m for m in sys.modules if m == {package!r} or m.startswith({package!r} + ".")}}


import {loader_module}

before = engine()
{load}
after = engine()
extra = None
{after_load}
print({mark!r} + json.dumps({{"new": sorted(after - before), "extra": extra}}))
"""


def plugin_imports(
    *,
    package: str,
    loader_module: str,
    load: str,
    env_var: str,
    opted_in: bool,
    prelude: str = "",
    after_load: str = "",
    env: dict | None = None,
    timeout: float = 300,
) -> tuple[list[str], object]:
    """``(new engine modules, extra)``: the ``package`` modules that ``load`` (a statement, run after
    ``import loader_module``) imported, and the value the ``after_load`` statements left in
    ``extra`` (JSON). ``env_var`` is set to ``1`` when ``opted_in``, removed otherwise."""
    script = _SCRIPT.format(
        prelude=textwrap.dedent(prelude),
        package=package,
        loader_module=loader_module,
        load=textwrap.dedent(load),
        after_load=textwrap.dedent(after_load),
        mark=_MARK,
    )
    environ = dict(os.environ, **(env or {}))
    environ.pop(env_var, None)
    if opted_in:
        environ[env_var] = "1"
    run = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in run.stdout.splitlines() if line.startswith(_MARK)]
    assert run.returncode == 0 and lines, f"rc={run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    found = json.loads(lines[-1][len(_MARK) :])
    return found["new"], found["extra"]

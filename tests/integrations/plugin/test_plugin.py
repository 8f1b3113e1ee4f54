"""The plugin plumbing the engine adapters share (chunkmeta.integrations.plugin), on its own.

The adapters' suites (vllm/, sglang/) run it through their engines' entry points; here each piece
is pinned down by itself: the opt-in values, the version gate, reversible patches (own,
inherited, replaced by someone else since) and import hooks (at once, on import, failing, undone).
"""

import importlib
import logging
import sys

import pytest

from chunkmeta import ChunkMetaError
from chunkmeta.integrations import plugin

log = logging.getLogger("chunkmeta.tests.plugin")


@pytest.mark.parametrize(
    "raw, allow_force, want",
    [
        (None, False, None),
        ("", False, None),
        ("0", False, None),
        (" Off ", False, None),
        ("no", False, None),
        ("1", False, "on"),
        ("TRUE", False, "on"),
        (" yes ", False, "on"),
        ("on", False, "on"),
        ("force", True, "force"),
        ("Force", True, "force"),
    ],
)
def test_opt_in_values(raw, allow_force, want):
    environ = {} if raw is None else {"CM_TEST": raw}
    assert plugin.opt_in("CM_TEST", log, allow_force=allow_force, environ=environ) == want


@pytest.mark.parametrize("raw, allow_force", [("maybe", False), ("force", False), ("2", True)])
def test_opt_in_refuses_what_it_does_not_understand(raw, allow_force, caplog):
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert plugin.opt_in("CM_TEST", log, allow_force=allow_force, environ={"CM_TEST": raw}) is None
    assert f"CM_TEST={raw!r} is not understood" in caplog.text and "stays off" in caplog.text
    assert ("force for an untested release" in caplog.text) == allow_force


def test_enable_installs_only_when_opted_in_and_never_raises(monkeypatch, caplog):
    calls = []
    monkeypatch.delenv("CM_TEST", raising=False)
    assert plugin.enable("CM_TEST", log, "Engine", calls.append) is None and calls == []
    monkeypatch.setenv("CM_TEST", "force")
    assert plugin.enable("CM_TEST", log, "Engine", lambda force: calls.append(force) or "ok", allow_force=True) == "ok"
    monkeypatch.setenv("CM_TEST", "1")
    plugin.enable("CM_TEST", log, "Engine", calls.append)
    assert calls == [True, False]

    def broken(force):
        raise ImportError("cannot import name 'Backend'")

    with caplog.at_level(logging.WARNING, logger=log.name):
        assert plugin.enable("CM_TEST", log, "Engine", broken) is None
    assert "not enabled in Engine, which keeps its own chunk metadata: ImportError: cannot import name" in caplog.text


def test_release():
    assert plugin.release("0.33.0+rocm700") == (0, 33, 0)
    assert plugin.release("0.5.23.post1") == (0, 5, 23)
    assert plugin.release("0.5.23rc1") == (0, 5, 23)
    assert plugin.release("dev") == ()


def test_version_gate(caplog):
    exact = plugin.VersionGate("vLLM", "0.33.0", "0.33.0", fix="install vllm==0.33.0.")
    assert exact.tested == "0.33.0" and exact.is_tested("0.33.0+cu130") and not exact.is_tested("0.33.1")
    exact.check("0.33.0", log)
    for version in ("0.32.9", "0.34.0"):
        with pytest.raises(
            ChunkMetaError,
            match=rf"vLLM {version} is untested with chunkmeta's vLLM adapter, "
            r"which supports 0\.33\.0: install vllm==0\.33\.0\.",
        ):
            exact.check(version, log)
        exact.check(version, log, allow_untested=True)

    ranged = plugin.VersionGate("SGLang", "0.5.9", "0.5.23", fix="upgrade SGLang.", newer_warns=True)
    assert ranged.tested == "0.5.9 to 0.5.23" and ranged.is_tested("0.5.12")
    with pytest.raises(ChunkMetaError, match=r"sglang_copy 0\.5\.8 is untested .* supports 0\.5\.9 to 0\.5\.23"):
        ranged.check("0.5.8", log, label="sglang_copy")
    with caplog.at_level(logging.WARNING, logger=log.name):
        ranged.check("0.6.0", log)
    assert "SGLang 0.6.0 is newer than the newest release tested (0.5.23)" in caplog.text


class Base:
    def method(self):
        return "base"


class Own(Base):
    def method(self):
        return "own"


class Inheriting(Base):
    pass


def test_patches_restore_own_and_inherited_attributes():
    patches = plugin.Patches(log, "Engine")
    original = Own.__dict__["method"]
    mine = patches.apply(Own, "method", lambda self: "ours")
    inherited = patches.apply(Inheriting, "method", lambda self: "ours")
    assert Own().method() == Inheriting().method() == "ours"
    assert patches.current(Own, "method") is mine and patches.current(Inheriting, "method") is inherited
    assert [p.owner for p in patches.applied()] == [Own, Inheriting]
    patches.undo()
    assert Own.__dict__["method"] is original and "method" not in Inheriting.__dict__
    assert Inheriting().method() == "base"  # follows its base class again
    assert patches.applied() == [] and patches.current(Own, "method") is None
    patches.undo()  # idempotent


def test_patches_leave_a_later_replacement_alone(caplog):
    patches = plugin.Patches(log, "Engine")
    original = Own.__dict__["method"]
    patches.apply(Own, "method", lambda self: "ours")

    def later(self):
        return "later"

    Own.method = later
    try:
        assert patches.current(Own, "method") is None  # no longer ours: a re-install wraps theirs
        with caplog.at_level(logging.WARNING, logger=log.name):
            patches.undo()
        assert (
            Own.__dict__["method"] is later and "Own.method was replaced after install(); left as it is" in caplog.text
        )
    finally:
        Own.method = original


MODULE = "VALUE = 41\n"


def importable(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def hooks():
    return [f for f in sys.meta_path if isinstance(f, plugin.ImportHook)]


def test_when_imported_waits_for_the_engines_import(tmp_path, monkeypatch):
    name = "cm_plugin_deferred"
    importable(tmp_path, monkeypatch, name)
    patches = plugin.Patches(log, "Engine")
    seen = []
    patches.when_imported(name, lambda module: seen.append(module.VALUE))
    patches.when_imported(name, lambda module: seen.append("twice"))  # one hook per module
    assert name not in sys.modules and patches.pending() == (name,) and seen == []
    importlib.import_module(name)
    assert seen == [41] and patches.pending() == () and hooks() == []
    patches.when_imported(name, lambda module: seen.append("now"))  # imported already: at once
    assert seen == [41, "now"]


def test_when_imported_failures_never_break_the_import(tmp_path, monkeypatch, caplog):
    name = "cm_plugin_failing"
    importable(tmp_path, monkeypatch, name)
    patches = plugin.Patches(log, "Engine")

    def wire(module):
        raise ChunkMetaError("Backend.get_builder_cls() returns object")

    patches.when_imported(name, wire)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert importlib.import_module(name).VALUE == 41
    assert f"wiring {name} failed, Engine keeps its own: ChunkMetaError: Backend.get_builder_cls()" in caplog.text
    with pytest.raises(ChunkMetaError):  # at once, the caller (install) sees the error itself
        patches.when_imported(name, wire)


def test_undo_disarms_pending_hooks(tmp_path, monkeypatch):
    name = "cm_plugin_disarmed"
    importable(tmp_path, monkeypatch, name)
    patches = plugin.Patches(log, "Engine")
    seen = []
    patches.when_imported(name, seen.append)
    assert len(hooks()) == 1
    patches.undo()
    assert hooks() == [] and patches.pending() == ()
    importlib.import_module(name)
    assert seen == []

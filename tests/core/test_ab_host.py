"""bench/diagnostics/ab_host.py: another tree's chunkmeta loaded beside the current one in one
process, and the twins' tables compared field by field (CPU)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "diagnostics"))

import ab_host  # noqa: E402

import chunkmeta  # noqa: E402
from chunkmeta.replay import kda_tables, mamba2_tables  # noqa: E402


@pytest.fixture
def other(tmp_path):
    """This tree loaded again beside itself, as ab_host.py loads an old one; unloaded after."""
    yield ab_host.load_tree(ROOT, tmp_path, name="chunkmeta_ab_self")
    sys.path.remove(str(tmp_path))
    for name in [name for name in sys.modules if name.split(".")[0] == "chunkmeta_ab_self"]:
        del sys.modules[name]


def test_a_tree_loads_beside_the_current_one_and_its_twin_builds_equal_tables(tmp_path, other):
    assert other.__name__ == "chunkmeta_ab_self" and other.StepTablesBuilder is not chunkmeta.StepTablesBuilder
    # the same C sources, but an extension of its own (its static state is the tree's own)
    native = importlib.import_module("chunkmeta_ab_self.native")
    if chunkmeta.native.module() is not None:
        assert native.module() is not None and native.module() is not chunkmeta.native.module()
    # every module it imported is its own: no import of the renamed copy reached chunkmeta's
    loaded = [name for name in sys.modules if name.startswith("chunkmeta_ab_self.")]
    assert loaded and all(sys.modules[name].__file__.startswith(str(tmp_path)) for name in loaded)
    old_replay = importlib.import_module("chunkmeta_ab_self.replay")
    assert old_replay.kda_tables(64)["fla"].__class__ is not kda_tables(64)["fla"].__class__

    qsl = torch.tensor([0, 1, 2, 100, 300], dtype=torch.int32)
    computed = torch.tensor([3, 4, 0, 50], dtype=torch.int32)
    rows = dict(first_seq=2, num_computed_tokens=computed, num_computed_tokens_cpu=computed)
    new = chunkmeta.StepTablesBuilder(8, 1024, tables={**kda_tables(64), **mamba2_tables(256)}, device="cpu")
    old = other.StepTablesBuilder(
        8, 1024, tables={**old_replay.kda_tables(64), **old_replay.mamba2_tables(256)}, device="cpu"
    )
    a, b = new.build(qsl, qsl, **rows), old.build(qsl, qsl, **rows)
    fields = ab_host.fields(a)
    names = {"fla", "fla_batch", "conv", "mamba2", "mamba2_conv"}
    assert {key for key in fields if key.startswith("table ")} == {f"table {name}" for name in names}
    assert {"num_seqs", "padded"} <= set(fields)  # the step's own fields too
    assert any(isinstance(v, tuple) for v in fields["table mamba2"].values())  # tensors compared as bytes
    assert ab_host.same_tables(a, b)

    # a different batch, or one-table results against a step's, are not the same tables
    other_qsl = torch.tensor([0, 1, 2, 100, 301], dtype=torch.int32)
    assert not ab_host.same_tables(a, old.build(other_qsl, other_qsl, **rows))
    one = chunkmeta.build_chunk_metadata(qsl, qsl)
    assert ab_host.same_tables(one, other.build_chunk_metadata(qsl, qsl))
    assert not ab_host.same_tables(one, other.build_chunk_metadata(other_qsl, other_qsl))
    assert not ab_host.same_tables(one, a)
    assert isinstance(chunkmeta.build_chunk_metadata(qsl, qsl), chunkmeta.ChunkMetadata)  # its own type still

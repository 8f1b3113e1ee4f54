"""README.md and docs/design.md stay true: their python blocks run as written on a CPU machine.

Each file's ```python blocks run in order in one namespace of their own, as a reader pasting
them into one session would run them (later blocks use names earlier ones made); a block that
raises fails the test, named by its first line in the file. GPU- or engine-only code belongs in
comments or in blocks of another language.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUNNABLE = [README, ROOT / "docs" / "design.md"]
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "bench").rglob("README.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run_on_cpu(path):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no ```python block"
    namespace = {"__name__": "__readme__"}
    for line, code in blocks:
        # the first line in the compiled code object is the block's first line in the file
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)


def test_every_readme_block_is_checked():
    """A ```python block the regex missed (an indented fence, a typo) would go unchecked."""
    text = README.read_text()
    assert text.count("```python") == len(python_blocks(README))


def test_two_commands_exist_in_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make demo" in README.read_text() and "make test" in README.read_text()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve_and_no_machine_paths(path):
    text = path.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:", target):  # a relative link: the file must exist
            assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"
    assert not re.search(r"(?<![\w.$])/(work|tmp|root|home|opt)/", text), f"{path.name} names a machine path"

"""README.md stays true: its scheduler example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_scheduler_example_runs():
    text = README.read_text()
    section = text[text.index("## Integrating with a scheduler"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_two_commands_exist_in_the_makefile():
    makefile = (README.parent / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make demo" in README.read_text() and "make test" in README.read_text()

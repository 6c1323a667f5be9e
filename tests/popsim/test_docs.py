"""The docs stay true: their Python examples run, and the op reference matches popir's registry."""

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _blocks(name):
    """The complete Python examples of a doc (a block with ``...`` placeholders is a sketch, not run)."""
    text = (DOCS / name).read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "..." not in b]


@pytest.mark.parametrize("name", ["device_api.md", "frontends.md"])
def test_the_examples_of_a_doc_run(name):
    blocks = _blocks(name)
    assert blocks
    namespace = {}
    for block in blocks:
        exec(compile(block, str(DOCS / name), "exec"), namespace)


def test_the_op_reference_is_generated_from_the_registry():
    # In a fresh interpreter: ops that tests or doc examples register in this process are not popir's own.
    script = "import runpy, sys; sys.stdout.write(runpy.run_path(sys.argv[1])['reference']())"
    generated = subprocess.run(
        [sys.executable, "-c", script, str(DOCS / "make_op_reference.py")], capture_output=True, text=True, check=True
    ).stdout
    assert (DOCS / "ops.md").read_text() == generated, "run: python docs/make_op_reference.py"


def test_every_primitive_in_the_op_reference_has_a_description():
    undescribed = [
        line.split("`")[1] for line in (DOCS / "ops.md").read_text().splitlines() if "(no description)" in line
    ]
    assert not undescribed, f"give these ops a doc= (or a ref docstring): {undescribed}"

"""Every ```python block in docs/*.md runs (CPU; kernels in the interpreter)."""
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks():
    for page in sorted(DOCS.glob("*.md")):
        for i, code in enumerate(BLOCK.findall(page.read_text())):
            yield pytest.param(code, id=f"{page.stem}-{i}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_doc_block_runs(code):
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})

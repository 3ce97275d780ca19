"""Every code block in docs/*.md runs: ```python blocks in this process (CPU; kernels in
the interpreter), ```bash blocks in a shell at the repository root."""
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.S)


def _blocks(kind):
    for page in sorted(DOCS.glob("*.md")):
        blocks = [code for lang, code in BLOCK.findall(page.read_text()) if lang == kind]
        for i, code in enumerate(blocks):
            yield pytest.param(code, id=f"{page.stem}-{i}")


@pytest.mark.parametrize("code", list(_blocks("python")))
def test_python_block_runs(code):
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("code", list(_blocks("bash")))
def test_bash_block_runs(code):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(["bash", "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

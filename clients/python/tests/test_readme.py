"""The README's example runs as written, against the test server."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import Server

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_example_runs_as_written(server: Server, alice_key: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python example"
    example = blocks[0].replace("http://127.0.0.1:7077", server.http)
    namespace: dict[str, object] = {"KEY": alice_key, "print": lambda *a: None}
    exec(compile(example, str(README), "exec"), namespace)
    hits = namespace["hits"]
    assert isinstance(hits, dict)
    assert "login fails" in hits["results"][0]["text"]

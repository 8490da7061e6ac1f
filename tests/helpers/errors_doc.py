"""docs/errors.md, read as the error tests' table: every row a bad input and the error it gets."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def table(heading: str) -> Dict[str, Tuple[str, str]]:
    """Rows of the table under ``heading`` in docs/errors.md: id -> (error type name, message)."""
    text = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("id", "---"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows



ERRORS = {"TypeError": TypeError, "ValueError": ValueError}

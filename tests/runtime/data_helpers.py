"""What the dataset tests share: a JSON Lines file written as users write theirs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def jsonl(path: Path, records: list[Any]) -> Path:
    """One record per line; a string is written as it is (a malformed line, on purpose)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path

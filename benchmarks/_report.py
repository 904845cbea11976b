"""Shared output for the benchmarks: the JSON document, then the readable table."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional


def emit(report: Dict[str, Any], table: str, json_path: Optional[str] = None) -> None:
    """Print ``report`` as JSON and ``table`` after it; also write the JSON to ``json_path``."""
    text = json.dumps(report, indent=2, default=str)
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(text + "\n")
    print(text)
    print()
    print(table)

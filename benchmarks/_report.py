"""Shared output for the benchmarks: the JSON document, then the readable table."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional


def write_json(report: Dict[str, Any], json_path: Optional[str]) -> None:
    """Write the full JSON ``report`` to ``json_path`` (if given) and say where."""
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(json.dumps(report, indent=2, default=str) + "\n")
        print(f"JSON written to {json_path}")


def emit(report: Dict[str, Any], table: str, json_path: Optional[str] = None) -> None:
    """Print the readable ``table``; write the full JSON ``report`` to ``json_path`` if given."""
    print(table)
    write_json(report, json_path)

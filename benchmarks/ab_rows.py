"""The JSON lines an A/B script (prepare_ab.py, decode_ab.py) wrote, one per process, and their
build labels in first-seen order (a line without a label, such as an environment line, is skipped)."""

import json


def ab_rows(path: str) -> tuple[list[dict], list[str]]:
    with open(path) as lines:
        rows = [row for row in (json.loads(line) for line in lines if line.startswith("{")) if "label" in row]
    return rows, list(dict.fromkeys(r["label"] for r in rows))

"""Files generated from the code (sample datasets, config references): written,
or checked against what the generator makes now."""

from __future__ import annotations

import os
import sys


def write_or_check(files: dict[str, str], check: bool, stale_hint: str) -> int:
    """Write each path's text, or with `check` only compare: 1 (after one line
    per stale or missing file, ending in `stale_hint`) when any differs, else 0."""
    stale = []
    for path, text in files.items():
        if check:
            if not os.path.exists(path):
                stale.append(path)
                continue
            with open(path) as f:
                if f.read() != text:
                    stale.append(path)
            continue
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    for path in stale:
        print(f"{path} differs from its generator: {stale_hint}", file=sys.stderr)
    return 1 if stale else 0

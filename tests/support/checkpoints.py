"""What tests/unit/test_checkpoint_trust.py and tests/e2e/test_checkpoint_trust.py share:
an attacker's pickle payload."""

from __future__ import annotations

import os


class Payload:
    """What an attacker's pickle does when it is loaded: here, make a directory."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))

"""What tests/unit/test_coevolve.py and tests/e2e/test_coevolve.py share: the shipped config."""

import os

from tests.conftest import REPO

CONFIG = os.path.join(REPO, "algorithms", "configs", "coevolve.yaml")

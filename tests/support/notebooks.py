"""What tests/unit/test_notebooks.py and tests/notebooks/test_notebooks.py share: the
notebooks in notebooks/."""

import glob
import os

from tests.conftest import REPO

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))

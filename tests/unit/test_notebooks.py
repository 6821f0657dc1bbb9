"""notebooks/ has notebooks (tests/notebooks/test_notebooks.py runs each)."""

import pytest

from tests.support.notebooks import NOTEBOOKS


@pytest.mark.unit
def test_there_are_notebooks():
    assert NOTEBOOKS

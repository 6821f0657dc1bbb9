"""The training layouts as tests name them: `kv_tree` is the tree layout forced onto
its KV-cache path (`meshrl.model.tree`), which runs past `DENSE_TREE_TOKENS` only."""

import contextlib
from collections.abc import Iterator

from meshrl.model import tree

LAYOUTS = ("packed", "tree", "kv_tree")


@contextlib.contextmanager
def laid_out(name: str) -> Iterator[str]:
    """The `trainer.layout` value to pass for `name`, the KV-cache path forced
    for `kv_tree` while the block runs."""
    if name != "kv_tree":
        yield name
        return
    saved, tree.DENSE_TREE_TOKENS = tree.DENSE_TREE_TOKENS, 0
    try:
        yield "tree"
    finally:
        tree.DENSE_TREE_TOKENS = saved

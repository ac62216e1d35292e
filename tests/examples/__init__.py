"""The names the docstrings' ``Example::`` blocks use, one module per runtime folder (:mod:`tests.test_examples`).

Each folder's module has ``NAMES: dict[str, Callable[[Path], Any]]``: for each name its examples read (a model, a
batch, files), how to make it; the argument is the block's working directory (a fresh temporary one). A block gets
only the names its source mentions, each made once per block (two names of one factory are one object), on top of
``common.NAMES`` and its module's own globals.
"""

"""The old path of :mod:`qkv.cli.train.options`: this name is that module, the same object, so an
import, an attribute read or a ``monkeypatch`` through either path sees one module."""

import qkv.cli.train.options as _module
from qkv.cli.train.options import *  # noqa: F403  (the names, for type checkers and readers)
from qkv.data._moved import alias

alias(__name__, _module)

"""The old path of :mod:`qkv.data.prepared.format`: this name is that module, the same object, so an
import, an attribute read or a ``monkeypatch`` through either path sees one module."""

import qkv.data.prepared.format as _module
from qkv.data._moved import alias
from qkv.data.prepared.format import *  # noqa: F403  (the names, for type checkers and readers)

alias(__name__, _module)

"""The old path of :mod:`qkv.data.prepared.preparing`: this name is that module, the same object, so an
import, an attribute read or a ``monkeypatch`` through either path sees one module."""

import qkv.data.prepared.preparing as _module
from qkv.data._moved import alias
from qkv.data.prepared.preparing import *  # noqa: F403  (the names, for type checkers and readers)

alias(__name__, _module)

"""Old module paths kept working after a module moved: the old name becomes the new module itself.

A module that moved leaves a small module at its old path which calls :func:`alias`. From then on
``sys.modules`` holds the new module under both names, so ``import`` and ``from ... import`` by the
old path give the very same objects (a pickle naming the old path unpickles to the same class), and
an attribute set through one path (``monkeypatch.setattr``) is seen through the other.
"""

import sys
from types import ModuleType


def alias(old: str, module: ModuleType) -> None:
    """Make the module named ``old`` the module ``module``.

    Args:
        old: the old dotted path (the caller's ``__name__``).
        module: the module that now holds the code.
    """
    sys.modules[old] = module

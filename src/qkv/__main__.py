"""``python -m qkv ...`` is ``qkv ...`` (e.g. under ``torchrun -m qkv``, or where the script is not on PATH)."""

import sys

from qkv.cli import main

sys.exit(main())

import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
import torch

torch.set_num_threads(1)  # the suite runs with pytest -n 2 on 2 cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    # one thread per test, again: a CLI call made in-process (main([...])) sets torch's threads to all cores
    # (qkv.cli.options), which would leave later tests on this worker with two threads each on two cores,
    # spin-waiting on each other (a 600-step test went from ~30 s to 240 s)
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- data sets
# Tests find Multi30k and tiny Shakespeare as a user's qkv does (qkv.data's lookup: $QKV_DATA, then qkv's
# cache), never by a path of their own. Not found: the test skips saying what is missing and how to get it,
# and fails instead where QKV_REQUIRE_DATA=1 (CI: .ci/run sets it, and QKV_DATA to the shared data folder beside the checkout).
HOW_TO_GET = (
    " (QKV_DATA=FOLDER, a folder holding multi30k/ and tinyshakespeare/, e.g. the shared data folder "
    "beside the checkout, whose README.md says where the files come from), or download it into qkv's cache "
    "with: "
    "python -c 'from {module} import {function}; {function}()'"
)


def data_required() -> bool:
    """True where a missing data set fails the test instead of skipping it (QKV_REQUIRE_DATA=1)."""
    return os.environ.get("QKV_REQUIRE_DATA", "").strip() not in ("", "0")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test for want of its data, or fail it where QKV_REQUIRE_DATA=1."""
    if data_required():
        pytest.fail(f"{reason} [QKV_REQUIRE_DATA=1: a missing data set is a failure]", pytrace=False)
    pytest.skip(reason)


def find_multi30k() -> Path:
    """The folder holding the Multi30k task-1 files, found by qkv.data.resolve_multi30k (never downloaded)."""
    from qkv.data.parallel import resolve_multi30k

    try:
        return resolve_multi30k(None, download=False).resolve()
    except FileNotFoundError as err:
        missing = str(err)  # skipped outside the except: no chained traceback
    skip_or_fail(missing + HOW_TO_GET.format(module="qkv.data", function="resolve_multi30k"))


def find_tinyshakespeare() -> Path:
    """The folder holding tiny Shakespeare's input.txt, found by qkv.data.text.resolve_tinyshakespeare
    (never downloaded)."""
    from qkv.data.text import resolve_tinyshakespeare

    try:
        return resolve_tinyshakespeare(None, download=False).resolve().parent
    except FileNotFoundError as err:
        missing = str(err)  # skipped outside the except: no chained traceback
    skip_or_fail(missing + HOW_TO_GET.format(module="qkv.data.text", function="resolve_tinyshakespeare"))


@pytest.fixture
def multi30k_dir() -> Path:
    """The Multi30k folder (train.en.gz, val.de.gz, test_2016_flickr.fr.gz, ...), as qkv finds it."""
    return find_multi30k()


@pytest.fixture
def tinyshakespeare_dir() -> Path:
    """The folder holding tiny Shakespeare's input.txt, as qkv finds it."""
    return find_tinyshakespeare()


@pytest.fixture
def multi30k_file(multi30k_dir) -> Callable[[str], Path]:
    """``multi30k_file("test_2016_flickr.fr.gz")``: that file of the Multi30k folder qkv finds, or a skip
    (a failure under QKV_REQUIRE_DATA=1) where the folder lacks it, as qkv's download does (English and German only)."""

    def path(name: str) -> Path:
        if not (multi30k_dir / name).is_file():
            skip_or_fail(
                f"Multi30k's {name} not found in {multi30k_dir} (qkv's download fetches English and German "
                "only): set QKV_DATA to a folder holding the whole multi30k/ (QKV_DATA=FOLDER, e.g. the shared data "
                "folder beside the checkout)"
            )
        return multi30k_dir / name

    return path

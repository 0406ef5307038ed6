"""Tests find Multi30k and tiny Shakespeare as a user's qkv does ($QKV_DATA, then qkv's cache; see
tests/conftest.py): where neither holds the data, a data test skips saying what is missing and how to
get it, and under CI (QKV_REQUIRE_DATA=1, set by .ci/run) that skip is a failure."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

FIXTURES = {"multi30k_dir": "Multi30k not found in", "tinyshakespeare_dir": "tiny Shakespeare (input.txt) not found in"}


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """QKV_DATA an empty folder, qkv's cache another, and no download."""
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("QKV_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("tried to download"))
    return tmp_path


@pytest.mark.parametrize("fixture", FIXTURES)
def test_missing_data_skips_naming_the_data_and_how_to_get_it(fixture, nowhere, monkeypatch, request):
    monkeypatch.delenv("QKV_REQUIRE_DATA", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        request.getfixturevalue(fixture)
    reason = str(skipped.value)
    assert reason.startswith(FIXTURES[fixture])
    assert str(nowhere / "data") in reason and str(nowhere / "cache") in reason  # where it looked
    assert "set QKV_DATA" in reason and "QKV_DATA=FOLDER" in reason and "python -c 'from qkv.data" in reason
    assert not (nowhere / "cache").exists()  # nothing downloaded, no cache folder made


@pytest.mark.parametrize("fixture", FIXTURES)
def test_missing_data_fails_where_data_is_required(fixture, nowhere, monkeypatch, request):
    monkeypatch.setenv("QKV_REQUIRE_DATA", "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        request.getfixturevalue(fixture)
    assert str(failed.value).startswith(FIXTURES[fixture]) and "QKV_REQUIRE_DATA=1" in str(failed.value)


@pytest.mark.parametrize("required", ["", "0", "1"])
def test_a_missing_file_of_a_found_folder_skips_or_fails(required, nowhere, monkeypatch, request):
    """A Multi30k folder without the French files (qkv's download fetches English and German only)."""
    folder = nowhere / "data" / "multi30k"
    folder.mkdir()
    (folder / "train.en").write_text("a dog\n")
    monkeypatch.setenv("QKV_REQUIRE_DATA", required)
    multi30k_file = request.getfixturevalue("multi30k_file")
    assert multi30k_file("train.en") == folder.resolve() / "train.en"
    expected = pytest.fail.Exception if required == "1" else pytest.skip.Exception
    with pytest.raises(expected, match="Multi30k's train.fr.gz not found in .*QKV_DATA"):
        multi30k_file("train.fr.gz")


def test_the_cache_is_searched_after_qkv_data(nowhere, request):
    """Where $QKV_DATA lacks the data, qkv's cache (here $QKV_CACHE) is where the lookup goes next."""
    (nowhere / "cache" / "multi30k").mkdir(parents=True)
    (nowhere / "cache" / "multi30k" / "train.en.gz").write_bytes(b"")
    (nowhere / "cache" / "tinyshakespeare").mkdir()
    (nowhere / "cache" / "tinyshakespeare" / "input.txt").write_text("First Citizen:\n")
    assert request.getfixturevalue("multi30k_dir") == (nowhere / "cache" / "multi30k").resolve()
    assert request.getfixturevalue("tinyshakespeare_dir") == (nowhere / "cache" / "tinyshakespeare").resolve()


def test_the_data_sets_qkv_finds_are_the_ones_the_tests_read(multi30k_dir, tinyshakespeare_dir):
    """Where the data is (CI: QKV_DATA set by .ci/run), the fixtures hand the tests what qkv's own
    loaders read: Multi30k's splits and tiny Shakespeare's text."""
    from qkv.data import load_multi30k
    from qkv.data.text import load_text_splits

    assert len(load_multi30k(multi30k_dir, "val", "en", "de")) == 1014
    train, valid, where = load_text_splits({"source": "tinyshakespeare", "folder": None})
    assert Path(where.split(" (")[0]).resolve() == tinyshakespeare_dir / "input.txt"
    assert train.startswith("First Citizen:") and len(train) + len(valid) > 1_000_000

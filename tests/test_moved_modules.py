"""The prepared folder's modules moved into the package ``qkv.data.prepared``: every old path is
still importable and is the very module of its new path, so names, classes and patches agree."""

import importlib
import pickle
import subprocess
import sys

import pytest

MOVED = {
    "qkv.data.prepared_format": "qkv.data.prepared.format",
    "qkv.data.prepared_integrity": "qkv.data.prepared.integrity",
    "qkv.data.prepared_writer": "qkv.data.prepared.writer",
    "qkv.data.preparing": "qkv.data.prepared.preparing",
    "qkv.data.preparing_workers": "qkv.data.prepared.workers",
}

# what the flat qkv/data/prepared.py exported, and the module each name is defined in now
PREPARED_NAMES = {
    "CACHE_FILE": "integrity",
    "FORMAT": "format",
    "MARKER": "format",
    "PreparedCorpus": "corpus",
    "PreparedSplit": "corpus",
    "building_folder": "writer",
    "folder_fingerprint": "format",
    "is_prepared_folder": "format",
    "split_files": "format",
    "token_dtype": "format",
    "write_token_lists": "writer",
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_is_the_new_module(old, new):
    module = importlib.import_module(new)
    assert importlib.import_module(old) is module
    public = [name for name in vars(module) if not name.startswith("_")]
    assert public
    legacy = importlib.import_module(old)
    for name in public:
        assert getattr(legacy, name) is getattr(module, name), name


def test_the_package_exports_what_the_flat_module_did():
    import qkv.data.prepared as package

    assert sorted(package.__all__) == sorted(PREPARED_NAMES)
    for name, home in PREPARED_NAMES.items():
        defined = importlib.import_module(f"qkv.data.prepared.{home}")
        assert getattr(package, name) is getattr(defined, name), name


def test_a_patch_through_the_old_path_is_seen_through_the_new(monkeypatch):
    from qkv.data import prepared_integrity
    from qkv.data.prepared import integrity

    monkeypatch.setattr(prepared_integrity, "SCAN_ITEMS", 3)
    assert integrity.SCAN_ITEMS == 3


def test_from_import_of_the_old_paths_in_a_fresh_interpreter():
    """In a new process, the old paths imported first (before the package), the way user code would."""
    code = (
        "from qkv.data.preparing import prepare_corpus, REASONS\n"
        "from qkv.data.prepared_writer import write_token_lists\n"
        "from qkv.data.prepared_format import is_prepared_folder\n"
        "import qkv.data.prepared.preparing as p, qkv.data.prepared.writer as w\n"
        "assert prepare_corpus is p.prepare_corpus and write_token_lists is w.write_token_lists\n"
        "import qkv.data.prepared_integrity, qkv.data.preparing_workers\n"
        "assert qkv.data.preparing_workers.Encoders.__module__ == 'qkv.data.prepared.workers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_class_pickled_by_its_old_path_unpickles_to_the_same_class():
    from qkv.data.prepared.workers import Encoders

    # protocol 0 names the class by module and name in plain text: write the old module's name
    data = pickle.dumps(Encoders, protocol=0).replace(b"qkv.data.prepared.workers", b"qkv.data.preparing_workers")
    assert b"qkv.data.preparing_workers" in data
    assert pickle.loads(data) is Encoders

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


# ----------------------------------------------------------------------------- qkv train's package
# qkv train's three files became the package qkv.cli.train: the old module paths, and the names the
# single train.py had, are the very objects of their new homes
TRAIN_MOVED = {"qkv.cli.train_options": "qkv.cli.train.options", "qkv.cli.train_help": "qkv.cli.train.help"}
TRAIN_NAMES = {  # what tests and benchmarks import from qkv.cli.train -> the module (.name) it is defined in
    "DATA_OPTIONS": "options",
    "GROUP_TITLES": "options",
    "LM_OPTIONS": "options",
    "MODEL_OPTIONS": "options",
    "add_cli_options": "options",
    "add_model_arguments": "options",
    "add_train_arguments": "options",
    "flag_of": "options",
    "model_options_from": "options",
    "train_options_from": "options",
    "data_spec": "data",
    "Terminated": "stopping",
    "sigterm_saves_first": "stopping",
    "sigterm_restored": "stopping",
    "_train": "stopping.train_and_report",  # its name while the command was one file
}


@pytest.mark.parametrize("old, new", sorted(TRAIN_MOVED.items()))
def test_an_old_train_module_path_is_the_new_module(old, new):
    module = importlib.import_module(new)
    legacy = importlib.import_module(old)
    assert legacy is module
    public = [name for name in vars(module) if not name.startswith("_")]
    assert "ShortHelp" in public or "CLI_OPTIONS" in public
    for name in public:
        assert getattr(legacy, name) is getattr(module, name), name


def test_the_train_command_keeps_its_names():
    import qkv.cli.train as command

    assert importlib.import_module("qkv.cli.train") is command
    assert hasattr(command, "__path__"), "qkv.cli.train is a package"
    assert callable(command.run) and callable(command.add_arguments) and command.OWN_HELP is True
    for name, home in TRAIN_NAMES.items():
        module, _, defined_as = home.partition(".")
        defined = importlib.import_module(f"qkv.cli.train.{module}")
        assert getattr(command, name) is getattr(defined, defined_as or name), name
    # the command registry still finds the command where it looked
    from qkv.cli import COMMANDS

    assert COMMANDS["train"][0] == "qkv.cli.train"


def test_a_patch_through_the_old_train_path_is_seen_through_the_new(monkeypatch):
    from qkv.cli import train_options
    from qkv.cli.train import help as train_help
    from qkv.cli.train import options

    monkeypatch.setattr(train_options, "SHORT_HELP_GROUPS", ("data",))
    assert options.SHORT_HELP_GROUPS == ("data",)
    monkeypatch.setattr("qkv.cli.train_help.DEFAULT_DATA", "dates")
    assert train_help.DEFAULT_DATA == "dates"


def test_the_old_train_paths_in_a_fresh_interpreter():
    """In a new process, the old paths imported first (before the package), the way user code would."""
    code = (
        "from qkv.cli.train_help import ShortHelp, recipe_in_view\n"
        "from qkv.cli.train_options import MODEL_OPTIONS, add_train_arguments\n"
        "import qkv.cli.train.help as h, qkv.cli.train.options as o, qkv.cli.train as t\n"
        "assert ShortHelp is h.ShortHelp and recipe_in_view is h.recipe_in_view\n"
        "assert MODEL_OPTIONS is o.MODEL_OPTIONS is t.MODEL_OPTIONS and add_train_arguments is t.add_train_arguments\n"
        "assert h.ShortHelp.__module__ == 'qkv.cli.train.help'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

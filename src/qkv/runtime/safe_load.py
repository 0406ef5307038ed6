"""Reading files someone else may have made: nothing in them runs code, and no number in them makes
qkv spend memory before it has been checked against the bytes that are really there.

Three rules, each applied by every loader:

* **Pickles are never trusted.** ``state.pt`` is read with ``torch.load(weights_only=True)``
  (tensors, numbers, strings and containers only); :func:`read_dcp_metadata` reads the pickled
  metadata of an FSDP optimizer shard folder through an unpickler that accepts only the classes
  ``torch.distributed.checkpoint`` itself writes. Weights are safetensors, configs and tokenizers JSON.
* **A config is compared with its weights before the model is built.** :func:`weights_header` reads a
  safetensors header (names, shapes, dtypes) without reading any tensor. :func:`check_layer_counts`
  compares the layer counts a config asks for with the layers the header holds (a model with 10,000
  layers would take minutes to build even without memory); :func:`build_within_weights` then builds
  the model on PyTorch's ``meta`` device (shapes, no storage), compares every tensor with the
  header, and refuses a model whose tensors and buffers (a positional table sized by ``max_len``,
  say) would need far more memory than the weights file holds. Only then is the model built.
* **Every error is one line naming the file and the field** (``ValueError``), so the CLI reports it
  as ``qkv <command>: error: ...``.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from qkv.runtime.meta import meta_device
from qkv.runtime.textinput import check_input_file

if TYPE_CHECKING:  # torch.distributed is imported only where a sharded checkpoint is read
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

# Memory a model may need beyond its weights file, for buffers the file does not hold (positional
# tables, masks): generous for every real configuration, far below what a hostile one asks.
BUFFER_ALLOWANCE_BYTES = 256 * 2**20

_SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}


class TensorInfo:
    """One tensor of a safetensors header: its shape and dtype name (``"F32"``, ...)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape, self.dtype = shape, dtype

    @property
    def numel(self) -> int:
        """The number of elements of the tensor's shape."""
        n = 1
        for size in self.shape:
            n *= size
        return n


def weights_header(path: str | Path) -> dict[str, TensorInfo]:
    """The names, shapes and dtypes in a safetensors file, read from its header alone.

    Raises:
        FileNotFoundError / IsADirectoryError / PermissionError: no such file, a folder, or one
            this user may not read.
        ValueError: not a readable safetensors file (one line naming it).
    """
    path = Path(path)
    try:
        check_input_file(path, "weights file")  # a folder or an unreadable file: each said as it is
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: weights file not found") from None
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = {}
            names = handle.keys()  # a safe_open handle is no mapping: neither iterable nor `in`-able
            for name in names:
                piece = handle.get_slice(name)
                header[name] = TensorInfo(tuple(int(s) for s in piece.get_shape()), str(piece.get_dtype()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({_first_line(err)})") from None
    return header


def count_layers(names: Iterable[str], prefix: str) -> int:
    """How many layers ``prefix<i>.`` the names hold (the highest index plus one; 0 if none)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    indices = [int(m.group(1)) for m in map(pattern.match, names) if m]
    return max(indices) + 1 if indices else 0


def check_layer_counts(
    names: Iterable[str],
    asked: Mapping[str, tuple[str, int]],
    *,
    config_path: str | Path,
    weights_path: str | Path,
    only_more: bool = False,
) -> None:
    """Compare the layer counts a config asks for with the layers a weights file holds.

    Args:
        names: the weights file's tensor names.
        asked: ``{config field: (name prefix of its layers, the count the config gives)}``, e.g.
            ``{"num_encoder_layers": ("encoder.layers.", 6)}``.
        only_more: refuse only a config asking for more layers than the file holds (what makes
            building slow), leaving other mismatches to a check that lists the keys.

    Raises:
        ValueError: one line naming the config file, the field and both counts.
    """
    names = list(names)
    for field, (prefix, count) in asked.items():
        held = count_layers(names, prefix)
        if (count > held) if only_more else (held != count):
            raise ValueError(
                f"{config_path}: {field} is {count} but {weights_path} holds {held} such "
                f"layer{'' if held == 1 else 's'}; "
                "the config and the weights do not belong together"
            )


def check_shapes(
    expected: Mapping[str, tuple[int, ...]],
    header: Mapping[str, TensorInfo],
    *,
    config_path: str | Path,
    weights_path: str | Path,
    tied: Iterable[set[str]] = (),
    fields: Mapping[str, object] | None = None,
) -> None:
    """Compare the tensor shapes a config implies with those a weights file holds (names and shapes;
    floating-point dtypes). ``tied``: groups of names stored once (any one of a group may stand for all).
    ``fields``: the config's values, to name the field behind a wrong size.

    Raises:
        ValueError: one line naming the first unknown, missing or misshapen tensor.
    """
    unknown = sorted(set(header) - set(expected))
    if unknown:
        raise ValueError(f"{weights_path}: tensors the model of {config_path} does not have: {unknown[:5]}")
    for name, info in header.items():
        if tuple(expected[name]) != info.shape:
            raise ValueError(
                f"{weights_path}: {name} has shape {list(info.shape)} but {config_path} gives "
                f"{list(expected[name])}{_fields_behind(expected[name], info.shape, fields)}; "
                "the config and the weights do not belong together"
            )
        if info.dtype not in ("F32", "F16", "BF16", "F64"):
            raise ValueError(f"{weights_path}: {name} has dtype {info.dtype}, expected a floating-point tensor")
    groups = [set(g) for g in tied]
    grouped = set().union(*groups) if groups else set()
    missing = [name for name in expected if name not in header and name not in grouped]
    missing += [sorted(g)[0] for g in groups if not g & set(header)]
    if missing:
        raise ValueError(f"{weights_path}: weights missing for {sorted(missing)[:5]}")


def _fields_behind(asked: tuple[int, ...], held: tuple[int, ...], fields: Mapping[str, object] | None) -> str:
    """`` (from d_model = 1000000)``: the config fields whose value is a size that differs."""
    wrong = {a for a, h in zip(asked, held) if a != h} | (set(asked) if len(asked) != len(held) else set())
    names = [
        f"{k} = {v}" for k, v in (fields or {}).items() if isinstance(v, int) and not isinstance(v, bool) and v in wrong
    ]
    return f" (from {', '.join(names)})" if names else ""


def meta_shapes(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], list[set[str]]]:
    """A model's state-dict shapes and the groups of names that share one tensor (tied weights)."""
    shapes: dict[str, tuple[int, ...]] = {}
    by_tensor: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(tensor.shape)
        by_tensor.setdefault(id(tensor), set()).add(name)
    return shapes, [names for names in by_tensor.values() if len(names) > 1]


def model_bytes(model: nn.Module) -> tuple[int, str]:
    """Bytes a model's parameters and buffers take once built (each shared tensor once), and the
    name and shape of the largest, for the message when it is too much."""
    seen, total, largest = set(), 0, (0, "")
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        total += size
        if size > largest[0]:
            largest = (size, f"{name} {list(tensor.shape)}")
    return total, largest[1]


def header_bytes(header: Mapping[str, TensorInfo], as_float32: bool = True) -> int:
    """Bytes the header's tensors take (counted as float32 when the model will hold them so)."""
    return sum(info.numel * (4 if as_float32 else _SAFETENSORS_BYTES.get(info.dtype, 4)) for info in header.values())


def check_fits_weights(
    model: nn.Module, weights_bytes: int, *, config_path: str | Path, weights_path: str | Path
) -> None:
    """Refuse a model (built on the meta device) that needs far more memory than its weights:
    only buffers can make the difference, and :data:`BUFFER_ALLOWANCE_BYTES` covers every real one."""
    need, largest = model_bytes(model)
    if need > weights_bytes + BUFFER_ALLOWANCE_BYTES:
        raise ValueError(
            f"{config_path}: the model it describes needs {need / 2**30:.1f} GiB (largest: {largest}) "
            f"but {weights_path} holds {weights_bytes / 2**30:.2f} GiB of weights; refusing to build it"
        )


def build_within_weights(
    build: Callable[[], nn.Module],
    header: Mapping[str, TensorInfo],
    *,
    config_path: str | Path,
    weights_path: str | Path,
    fields: Mapping[str, object] | None = None,
) -> nn.Module:
    """Build ``build()`` only once its shapes match ``header`` exactly and its memory is bounded by
    the weights file: first on the meta device (no storage), then for real.

    The caller checks layer counts first (:func:`check_layer_counts`): building thousands of
    layers takes minutes even on the meta device.
    """
    try:
        with meta_device():
            probe = build()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{config_path}: bad model section ({_first_line(err)})") from None
    expected, tied = meta_shapes(probe)
    check_shapes(expected, header, config_path=config_path, weights_path=weights_path, tied=tied, fields=fields)
    check_fits_weights(probe, header_bytes(header), config_path=config_path, weights_path=weights_path)
    del probe
    return build()


# --- state.pt (a zip of pickled tensors) -------------------------------------------------------------


def check_zip_members(path: Path) -> None:
    """``state.pt`` is a zip archive whose every member has its CRC-32 (``torch.load`` checks none,
    so a changed byte would load as another training state) and none is marked a directory (which
    makes torch read a tensor as uninitialized memory). Reads the file once."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            folders = [info.filename for info in archive.infolist() if info.is_dir() or info.external_attr & 0x10]
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as err:
        raise ValueError(f"{path}: damaged training state ({type(err).__name__}); the run cannot be resumed") from None
    if damaged is not None or folders:
        raise ValueError(
            f"{path}: damaged training state ({damaged or folders[0]} does not match its checksum or "
            "type); the run cannot be resumed"
        )


def refused_global(err: BaseException) -> str:
    """The object torch's safe loader refused, from its long message (``posix.system``, ...)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return f"e.g. {found.group(1)}" if found else "objects beyond tensors and plain values"


def plain_values(value: object) -> object:
    """``value`` with numpy arrays as tensors, numpy scalars as numbers and dataclasses as dicts: the
    forms an older checkpoint may hold that the safe loader reads once converted."""
    import dataclasses

    import numpy as np

    if isinstance(value, dict):
        return {key: plain_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return (
            type(value)(plain_values(item) for item in value)
            if type(value) in (list, tuple)
            else [plain_values(item) for item in value]
        )
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_values(dataclasses.asdict(value))
    return value


# --- torch.distributed.checkpoint (FSDP optimizer shards) --------------------------------------------

# Exactly what torch.distributed.checkpoint pickles into a folder's .metadata (besides torch dtypes).
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the plain classes ``torch.distributed.checkpoint`` writes in ``.metadata`` (and
    torch's dtypes); anything else, ``os.system`` say, is refused by name before it is looked up."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The metadata of a ``torch.distributed.checkpoint`` folder, read without running any code
    (``ValueError`` naming the file if it holds anything but the checkpoint's own plain classes)."""
    path = Path(path)
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises almost any type
        raise ValueError(f"{path}: not a readable optimizer shard index ({_first_line(err)})") from None


def safe_dcp_load(state: dict[str, Any], folder: str | Path, *, no_dist: bool) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` from ``folder`` with nothing unpickled
    unsafely: the metadata through :func:`read_dcp_metadata`, every non-tensor item with
    ``torch.load(weights_only=True)`` (the default planner unpickles those fully)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            rank = kwargs.get("rank")
            metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            storage_meta: StorageMeta = getattr(metadata, "storage_meta", None) or StorageMeta()  # older ones lack it
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=Reader(str(folder)), planner=Planner(), no_dist=no_dist)
    except ValueError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - dcp wraps failures in a BaseException
        refused = re.search(r"GLOBAL ([\w.]+)", str(err))
        reason = f"refused to load {refused.group(1)}" if refused else _first_line(err)
        raise ValueError(f"{folder}: not readable optimizer shards ({reason})") from None


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = (str(err).strip() or type(err).__name__).splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."

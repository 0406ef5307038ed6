"""The key/value cache of decoding: the keys and values of the positions seen so far, kept between
steps (:class:`KVCache`), and the rows of several caches joined into one batch whose rows hold
their own positions (continuous batching, :mod:`qkv.inference.continuous`).

Shape legend: ``b`` rows, ``h_kv`` key/value heads, ``s_k`` keys kept, ``d_h`` head size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

ROOM = 128  # the key slots a grown cache holds beyond its keys: appends write in place until they are used


@dataclass
class _Room:
    """The storage a cache's keys and values are views of, with free slots after them.

    ``used``: the slots written so far (by the latest extension): only a cache whose keys end there may
    write the next ones in place; any other (an older step's cache, extended a second time) copies.
    """

    key: Tensor  # (b, h_kv, capacity, d_h)
    value: Tensor
    used: int


def _may_grow_in_place() -> bool:
    """Appending in place is for decoding: not under autograd, a trace, an ONNX export or torch.compile."""
    return not (
        torch.is_grad_enabled()
        or torch.jit.is_tracing()
        or torch.onnx.is_in_onnx_export()
        or torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
    )


@dataclass
class KVCache:
    """Projected keys and values kept between decoding steps.

    ``static=False`` (self-attention): each call appends the new step's keys and values.
    ``static=True`` (cross-attention): the memory's keys and values, computed once and reused.
    ``start``: the position of the first key kept (a sliding window drops the keys it no longer
    reaches; 0 otherwise), so the positions seen so far are ``start + len(cache)`` (:attr:`end`).
    ``positions``: ``(b,)`` the tokens each row has seen, when the rows differ (a batch whose
    members joined at different steps, :meth:`concat_rows`); each row's keys then end at the last
    slot (right-aligned), the slots before its first key are empty and masked
    (:meth:`padding_mask`), and its next query sits at its own position. None: every row at
    :attr:`end`.
    """

    key: Tensor  # (b, h_kv, s_k, d_h)
    value: Tensor  # (b, h_kv, s_k, d_h)
    static: bool = False
    start: int = 0
    positions: Tensor | None = None  # (b,) int64
    room: _Room | None = field(default=None, repr=False, compare=False)  # (decoding) storage with free slots
    offset: int = field(default=0, repr=False, compare=False)  # the first key's slot in room

    def __len__(self) -> int:
        return self.key.size(-2)

    @property
    def end(self) -> int:
        """The positions seen so far: the next query's position (every row's; see :attr:`next_positions`)."""
        return self.start + self.key.size(-2)

    @property
    def next_positions(self) -> int | Tensor:
        """The next query's position: :attr:`end`, or ``(b,)`` per row with :attr:`positions`."""
        return self.end if self.positions is None else self.positions

    def extend(self, key: Tensor, value: Tensor) -> KVCache:
        """This cache with ``key``, ``value`` ``(b, h_kv, s_new, d_h)`` appended after its own.

        While decoding (no autograd, trace or export), the keys live in storage with :data:`ROOM`
        free slots after them, so a step writes its keys in place instead of copying the whole cache
        (which made a long generation's appends quadratic); this cache stays as it was either way."""
        positions = None if self.positions is None else self.positions + key.size(-2)
        n, new = self.key.size(-2), key.size(-2)
        if not _may_grow_in_place():
            return KVCache(
                torch.cat([self.key, key], dim=-2), torch.cat([self.value, value], dim=-2), False, self.start, positions
            )
        room, end = self.room, self.offset + n
        if room is None or room.used != end or end + new > room.key.size(-2) or room.key.size(0) != key.size(0):
            room = _Room(self._storage(self.key, key), self._storage(self.value, value), n)
            room.key[..., :n, :], room.value[..., :n, :] = self.key, self.value
            end, offset = n, 0
        else:
            offset = self.offset
        room.key[..., end : end + new, :], room.value[..., end : end + new, :] = key, value
        room.used = end + new
        keys, values = room.key[..., offset : end + new, :], room.value[..., offset : end + new, :]
        return KVCache(keys, values, False, self.start, positions, room, offset)

    @staticmethod
    def _storage(kept: Tensor, new: Tensor) -> Tensor:
        shape = (*new.shape[:-2], kept.size(-2) + new.size(-2) + ROOM, new.size(-1))
        return new.new_empty(shape)

    def keep_last(self, n: int | None) -> KVCache:
        """The cache holding only its last ``n`` keys (what a window of ``n + 1`` needs next); None: all."""
        drop = self.key.size(-2) - n if n is not None else 0
        if drop <= 0:
            return self
        return KVCache(
            self.key[..., drop:, :],
            self.value[..., drop:, :],
            self.static,
            self.start + drop,
            self.positions,
            self.room,
            self.offset + drop,
        )

    def index_select(self, batch_index: Tensor) -> KVCache:
        """Reorder or repeat the batch rows (used by beam search, and by a batch that members leave)."""
        positions = None if self.positions is None else self.positions.index_select(0, batch_index)
        return replace(
            self,
            key=self.key.index_select(0, batch_index),
            value=self.value.index_select(0, batch_index),
            positions=positions,
            room=None,
            offset=0,
        )

    def padding_mask(self) -> Tensor | None:
        """``(b, 1, 1, s_k)`` bool, True at a row's real keys, with :attr:`positions` where some row
        has empty slots; None where every slot is real."""
        if self.positions is None or self.static:
            return None
        slots = self.key.size(-2)
        first = slots - self.positions  # (b,) the first real slot of each row (<= 0: all real)
        if int(first.max()) <= 0:
            return None
        return (torch.arange(slots, device=self.key.device)[None, :] >= first[:, None])[:, None, None, :]

    def trimmed(self) -> KVCache:
        """The cache without the leading slots that are empty in every row (after rows left)."""
        if self.positions is None or self.static:
            return self
        return self.keep_last(min(self.key.size(-2), int(self.positions.max())))

    @staticmethod
    def concat_rows(caches: list[KVCache]) -> KVCache:
        """The rows of several self-attention caches as one batch, right-aligned: each row keeps its
        own positions (:attr:`positions`), shorter ones padded with empty slots on the left."""
        slots = max(len(cache) for cache in caches)
        keys, values, positions = [], [], []
        for cache in caches:
            pad = slots - len(cache)
            key, value = cache.key, cache.value
            seen = cache.end if cache.positions is None else int(cache.positions.max())
            if pad and seen > len(cache):  # a window dropped its first keys: padding would unmask slots
                raise ValueError("cannot pad a cache that a window has cut to a longer batch's length")
            if pad:
                shape = (*key.shape[:-2], pad, key.size(-1))
                key = torch.cat([key.new_zeros(shape), key], dim=-2)
                value = torch.cat([value.new_zeros(shape), value], dim=-2)
            keys.append(key)
            values.append(value)
            rows = cache.key.size(0)
            if cache.positions is None:
                positions.append(torch.full((rows,), cache.end, dtype=torch.long, device=key.device))
            else:
                positions.append(cache.positions)
        return KVCache(torch.cat(keys), torch.cat(values), False, 0, torch.cat(positions))

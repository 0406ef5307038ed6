"""The KV cache's in-place appends (:class:`qkv.attention.cache.KVCache` with free slots after its keys)
hold exactly what concatenating every step's keys holds, whatever is done with older caches."""

from __future__ import annotations

import torch

from qkv.attention.cache import ROOM, KVCache


def steps(n: int, b: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 2, 1, 4, generator=g), torch.randn(b, 2, 1, 4, generator=g)) for _ in range(n)]


def by_hand(first: tuple[torch.Tensor, torch.Tensor], rest: list[tuple[torch.Tensor, torch.Tensor]]):
    keys = torch.cat([first[0], *[k for k, _ in rest]], dim=-2)
    values = torch.cat([first[1], *[v for _, v in rest]], dim=-2)
    return keys, values


@torch.no_grad()
def test_a_long_generation_holds_every_steps_keys():
    prompt = (torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    new = steps(2 * ROOM + 7)  # past the room twice: two regrowths
    cache = KVCache(*prompt)
    for i, (k, v) in enumerate(new):
        cache = cache.extend(k, v)
        if i in (0, ROOM, 2 * ROOM + 6):
            keys, values = by_hand(prompt, new[: i + 1])
            assert torch.equal(cache.key, keys) and torch.equal(cache.value, values)
    assert cache.room is not None and cache.end == 5 + len(new)


@torch.no_grad()
def test_older_caches_stay_as_they_were_and_branch_apart():
    prompt = (torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    (k1, v1), (k2, v2), (k3, v3) = steps(3, seed=1)
    base = KVCache(*prompt).extend(k1, v1)
    left = base.extend(k2, v2)  # in place, after base's keys
    right = base.extend(k3, v3)  # base again: its next slot is taken, so this one copies
    assert torch.equal(base.key, by_hand(prompt, [(k1, v1)])[0])
    assert torch.equal(left.key, by_hand(prompt, [(k1, v1), (k2, v2)])[0])
    assert torch.equal(right.key, by_hand(prompt, [(k1, v1), (k3, v3)])[0])
    assert torch.equal(right.value, by_hand(prompt, [(k1, v1), (k3, v3)])[1])
    assert torch.equal(left.extend(k3, v3).key, by_hand(prompt, [(k1, v1), (k2, v2), (k3, v3)])[0])


@torch.no_grad()
def test_a_sliding_window_keeps_its_last_keys_in_place():
    window = 6
    prompt = (torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    new = steps(ROOM + 20, b=1, seed=2)
    cache = KVCache(*prompt)
    for i, (k, v) in enumerate(new):
        cache = cache.extend(k, v).keep_last(window)
        keys, values = by_hand(prompt, new[: i + 1])
        assert torch.equal(cache.key, keys[..., -window:, :]) and torch.equal(cache.value, values[..., -window:, :])
        assert cache.start == max(0, keys.size(-2) - window)


def test_under_autograd_it_concatenates():
    key = torch.randn(1, 2, 3, 4, requires_grad=True)
    cache = KVCache(key, torch.randn(1, 2, 3, 4)).extend(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert cache.room is None and cache.key.shape == (1, 2, 4, 4)
    cache.key.sum().backward()
    assert torch.equal(key.grad, torch.ones_like(key))


@torch.no_grad()
def test_rows_selected_or_joined_own_their_keys():
    prompt = (torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4))
    (k1, v1), (k2, v2) = steps(2, b=3, seed=3)
    grown = KVCache(*prompt).extend(k1, v1)
    picked = grown.index_select(torch.tensor([2, 0]))
    assert picked.room is None
    later = grown.extend(k2, v2)  # writes into grown's storage: the picked rows must not see it
    keys = by_hand(prompt, [(k1, v1)])[0]
    assert torch.equal(picked.key, keys[[2, 0]])
    assert torch.equal(later.key, by_hand(prompt, [(k1, v1), (k2, v2)])[0])

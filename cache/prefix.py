"""Prefix caching: full KV token-blocks kept by the tokens they hold, so a request whose prompt
begins with tokens another request computed reuses those blocks instead of computing them.

A token-block is named by its key, a digest of its parent's key and its own block_size tokens:

    key_0 = H(b"" , t[0:B]),   key_i = H(key_{i-1}, t[iB:(i+1)B])

so equal keys mean equal tokens from position 0 on, and a block's K and V (which depend on every
token before it) are the same in any request that shares the key. Only full blocks are named:
the open block is still being written. A request with a cache salt keys its first block with
the salt (BLAKE2's keyed mode), so its whole chain differs from any other salt's or none: only
requests with the same salt share blocks.

Blocks stay named after their last owner leaves. Named blocks nobody holds wait in LRU order and
count as free: the pool takes the least recently used one when its free list is empty, and
forgets its name.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

Key = bytes


def block_keys(token_ids: Sequence[int], block_size: int, keys: list[Key], num_tokens: int,
               salt: str | None = None) -> list[Key]:
    """Extend ``keys`` (the chain of the first len(keys) token-blocks, in place) to cover the full
    token-blocks among the first ``num_tokens`` tokens; returns it. ``salt``: the requester's
    cache salt (None: shared with every request without one)."""
    for i in range(len(keys), num_tokens // block_size):
        if keys or salt is None:
            h = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
        else:
            h = hashlib.blake2b(digest_size=16, key=hashlib.blake2b(salt.encode()).digest()[:32])
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        keys.append(h.digest())
    return keys


class PrefixCache:
    """Which blocks hold which named token-block, and the order in which idle ones go.

    ``blocks[key]`` is the token-block's group of physical blocks ((K, V) for a KV cache);
    ``idle`` holds the keys of groups no request holds, least recently used first."""

    def __init__(self):
        self.blocks: dict[Key, tuple[int, ...]] = {}
        self._key_of: dict[int, Key] = {}           # first block of a named group -> its key
        self.idle: OrderedDict[Key, None] = OrderedDict()
        self.num_idle_blocks = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def key_of(self, group: Sequence[int]) -> Key | None:
        return self._key_of.get(group[0])

    def longest(self, keys: Sequence[Key], limit: int) -> int:
        """How many of the leading keys, at most ``limit``, are named here."""
        n, end, blocks = 0, min(limit, len(keys)), self.blocks
        while n < end and keys[n] in blocks:
            n += 1
        return n

    def held_blocks(self, keys: Sequence[Key]) -> int:
        """Blocks of these named groups that some request holds (not idle)."""
        return sum(len(self.blocks[k]) for k in keys if k not in self.idle)

    def name(self, key: Key, group: tuple[int, ...]) -> bool:
        """Name a group just filled; False when the key already names another (equal) group,
        which stays the one found."""
        if key in self.blocks or group[0] in self._key_of:
            return False
        self.blocks[key] = group
        self._key_of[group[0]] = key
        return True

    def held(self, key: Key) -> None:
        """A request holds the group again: it is no longer idle."""
        if key in self.idle:
            del self.idle[key]
            self.num_idle_blocks -= len(self.blocks[key])

    def released(self, key: Key) -> None:
        """Its last holder left: idle, most recently used."""
        self.idle[key] = None
        self.num_idle_blocks += len(self.blocks[key])

    def evict(self) -> tuple[int, ...] | None:
        """Forget the least recently used idle group; its blocks (None if none is idle)."""
        if not self.idle:
            return None
        key, _ = self.idle.popitem(last=False)
        group = self.blocks.pop(key)
        del self._key_of[group[0]]
        self.num_idle_blocks -= len(group)
        return group

"""KVBlockAllocator: which blocks of the KV buffer are free, who references them, and (prefix
caching) which full blocks hold the keys and values of a known token prefix.

A block is free (on the free list), referenced by one or more requests (ref count > 0), or cached:
registered under its prefix hash with no request referencing it. Cached blocks keep their keys and
values until their memory is needed; then the least recently released goes first.
"""

import hashlib
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np


def block_hash(parent: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its tokens and, through the parent's hash, every token before it.
    A 256-bit digest, so two different prefixes never share keys and values in practice."""
    digest = hashlib.sha256(parent or b"")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class KVBlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self.on_evict: Optional[Callable[[bytes], None]] = None
        """Called with the hash of each prefix that stops being cached (evicted, or all forgotten)."""

    def num_allocatable(self, excluding: Sequence[int] = ()) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones no request references,
        less those of `excluding` (cached blocks a request is about to retain)."""
        return len(self._free) + len(self._evictable) - sum(b in self._evictable for b in excluding)

    @property
    def num_free(self) -> int:
        """Blocks holding nothing: neither referenced nor cached."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of_hash)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with ref count 1; the free list first, then evicted cached blocks."""
        if count > self.num_allocatable():
            raise RuntimeError(f"allocate({count}): only {self.num_allocatable()} blocks can be allocated")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                hash_ = self._hash_of_block.pop(block)
                del self._block_of_hash[hash_]
                if self.on_evict is not None:
                    self.on_evict(hash_)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def retain(self, blocks: Sequence[int]) -> None:
        """One more reference to each of `blocks` (cached blocks a new request shares)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A block no one references becomes free, or stays
        cached when registered. Callers pass a request's blocks last first, so a prefix's tail is
        evicted before its head (a head without its tail is still useful; the reverse is not)."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self._hash_of_block:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, hash_: bytes) -> None:
        """Record that `block` holds the prefix `hash_` (its keys and values are written). A prefix
        already cached in another block keeps that block; this one stays private."""
        if hash_ not in self._block_of_hash and block not in self._hash_of_block:
            self._block_of_hash[hash_] = block
            self._hash_of_block[block] = hash_

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first one."""
        blocks = []
        for hash_ in hashes:
            block = self._block_of_hash.get(hash_)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def forget_cached(self) -> None:
        """Unregister every prefix (their keys and values are stale, e.g. after new weights); the
        cached blocks no request references become free."""
        self._free += list(self._evictable)
        self._evictable.clear()
        if self.on_evict is not None:
            for hash_ in self._block_of_hash:
                self.on_evict(hash_)
        self._hash_of_block.clear()
        self._block_of_hash.clear()

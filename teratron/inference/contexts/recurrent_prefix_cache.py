"""RecurrentPrefixCache: the recurrent layers' states at cached block boundaries (prefix caching
of hybrid models; Megatron's Mamba prefix cache, `prefix_caching_mamba_gb`).

A cached prefix is reusable by a Mamba-2 or Gated DeltaNet layer only where its state after the
prefix is known. The context stores, under the hash of a full block (`block_hash`: its tokens and
every token before it), every recurrent layer's state after that block, for the boundaries worth
keeping (see `DynamicInferenceContext.cached_prefix`). The entries live within a memory budget,
least recently used first out; an entry goes with its KV block when the KV allocator evicts it
(a state without the keys and values before it is of no use).
"""

from collections import OrderedDict


def _nbytes(states: dict) -> int:
    return sum(part.nbytes for state in states.values() for part in state)


class RecurrentPrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[bytes, dict] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, hash_: bytes) -> bool:
        return hash_ in self._entries

    def get(self, hash_: bytes) -> dict:
        """{layer number: state} after the block `hash_` (now the most recently used)."""
        self._entries.move_to_end(hash_)
        return self._entries[hash_]

    def put(self, hash_: bytes, states: dict) -> None:
        """Keep `states` ({layer number: state}) after the block `hash_`, evicting the least
        recently used entries to stay within the budget (nothing kept when they alone exceed it)."""
        self.drop(hash_)
        size = _nbytes(states)
        if size > self.budget_bytes:
            return
        while self.nbytes + size > self.budget_bytes:
            self.drop(next(iter(self._entries)))
        self._entries[hash_] = states
        self.nbytes += size

    def drop(self, hash_: bytes) -> None:
        states = self._entries.pop(hash_, None)
        if states is not None:
            self.nbytes -= _nbytes(states)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

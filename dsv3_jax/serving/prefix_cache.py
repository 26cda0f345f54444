"""Prefix caching: prompts that share a prefix (a system prompt, the context of several choices)
reuse its latent cache rows instead of prefilling them again.

Granularity is the prefill chunk: block k of a prompt holds the cache rows of positions
[k W, (k + 1) W) (W = the runner's `chunk`), which the full prefill chunk at k W writes and which
depend only on the prompt's first (k + 1) W tokens. A block is keyed by a hash chain over those
tokens (key_k = sha256(key_{k-1}, tokens of block k)), so a lookup walks the prompt once. A prompt of
T tokens reuses at most its first (T - 1) // W blocks: its last token is always prefilled, since its
logits give the first generated token. With the same chunks run from the same rows, a request's
tokens are exactly those of a prefill from scratch (`tests/serving/test_engine.py`).

Blocks live on the device, at most `capacity` of them, evicted least recently used (a hit refreshes
every block of the matched prefix).
"""

from __future__ import annotations

import collections

from dsv3_jax.inference.page_pool import block_keys


class PrefixCache:
    """Device cache-row blocks by prefix key, least recently used evicted past `capacity`."""

    def __init__(self, capacity: int, width: int):
        if capacity < 1:
            raise ValueError(f"prefix cache capacity must be >= 1 block, got {capacity}")
        self.capacity, self.width = capacity, width
        self.blocks: collections.OrderedDict[bytes, object] = collections.OrderedDict()

    def match(self, prompt: list[int]) -> list[object]:
        """The cached blocks of the prompt's longest cached prefix, in order (refreshed as recent)."""
        found = []
        for key in block_keys(prompt, self.width, (len(prompt) - 1) // self.width):  # the last token is prefilled
            block = self.blocks.get(key)
            if block is None:
                break
            self.blocks.move_to_end(key)
            found.append(block)
        return found

    def wants(self, prompt: list[int], k: int) -> bytes | None:
        """The key under which block k of the prompt should be stored, or None when it is cached
        already or is not a whole block of the prompt."""
        if (k + 1) * self.width > len(prompt):
            return None
        key = block_keys(prompt, self.width, k + 1)[-1]
        return None if key in self.blocks else key

    def put(self, key: bytes, block) -> None:
        self.blocks[key] = block
        self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

"""The server's prompt cache: the keys and values of sequences that finished, kept so that a later prompt
that begins with the same tokens (the next turn of a chat, which re-sends the history; a shared system
prompt) starts from them and prefills only the rest (vLLM's automatic prefix caching, llama-server's
prompt cache). Least recently used entries go first past a byte budget; an entry that a longer one
extends is dropped for it. The reused keys and values are the very ones the first prefill computed;
the rest of the prompt is prefilled after them (with other prompts that arrived with it: engine.py),
whose products run over fewer rows than a whole prefill's, so logits can differ from an uncached
prefill's in their last bits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_REUSE = 16  # tokens: a shorter common start is not worth a copy


@dataclass
class Entry:
    tokens: list[int]  # the tokens whose keys and values k, v hold, in order
    k: torch.Tensor  # (layers, n_kv, len(tokens), record): one row of the KV cache's layout
    v: torch.Tensor


class PromptCache:
    def __init__(self, budget_bytes: int):
        self.budget, self.bytes = budget_bytes, 0
        self.entries: list[Entry] = []  # least recently used first
        self.hits = self.reused_tokens = 0

    def put(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a finished sequence's keys and values (copies) for its tokens."""
        size = k.nbytes + v.nbytes
        if len(tokens) < MIN_REUSE or size > self.budget:
            return
        for e in [e for e in self.entries if e.tokens == tokens[:len(e.tokens)]]:  # superseded
            self._drop(e)
        self.entries.append(Entry(list(tokens), k.clone(), v.clone()))
        self.bytes += size
        while self.bytes > self.budget:
            self._drop(self.entries[0])

    def match(self, ids: list[int]) -> tuple[int, Entry | None]:
        """The longest start of `ids` an entry holds (at most all but the last token: its logits are
        needed), and that entry; (0, None) below MIN_REUSE."""
        best, found = 0, None
        for e in self.entries:
            n = common_start(e.tokens, ids, len(ids) - 1)
            if n > best:
                best, found = n, e
        if best < MIN_REUSE:
            return 0, None
        self.entries.remove(found)
        self.entries.append(found)  # most recently used
        return best, found

    def took(self, n: int) -> None:
        """A prompt took its first n tokens' keys and values from a match (its group's may take fewer)."""
        self.hits, self.reused_tokens = self.hits + 1, self.reused_tokens + n

    def _drop(self, e: Entry) -> None:
        self.entries.remove(e)
        self.bytes -= e.k.nbytes + e.v.nbytes


def common_start(a: list[int], b: list[int], most: int) -> int:
    n = min(len(a), len(b), most)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

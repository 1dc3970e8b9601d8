"""Drafts without a model: guesses of a request's next tokens from text already seen (pure Python).

- `ngram` (prompt lookup): the last n tokens of the request (n from MAX_N down to 1) are looked up
  in its own prompt and output, and what followed their latest earlier occurrence is proposed, or
  where the copy the last draft began has reached, if the text still follows it as closely.
  Edits of code, answers that quote a document and multi-turn chats copy from their input.
- `suffix`: the same lookup, and where the request's own text has no match, in the text of recent
  requests of the same tenant (cache salt, as the prefix cache keys it), so that structures that
  repeat across requests are drafted too. The index is bounded (SUFFIX_TOKENS), oldest out first.

A request's own lookup is a vectorised search over its last SEARCH_TOKENS tokens (no index that grows
with every running request's context); the suffix index maps each n-gram of finished requests to
where it last ended, a few dict reads per lookup, and holds SUFFIX_TOKENS tokens at most.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ppserve.scheduler.request import Request

MODES = ("off", "ngram", "suffix")
MAX_N = 4  # longest n-gram looked up (longer matches are tried first)
SEARCH_TOKENS = 1 << 14  # a request's own lookup searches its last this many tokens (bounded work)
SUFFIX_TOKENS = 1 << 15  # tokens of finished requests the suffix index holds, all tenants together
Gram = tuple[int, ...]


class TokenBuffer:
    """One request's tokens in a growing int64 array, searched for earlier occurrences of its tail.

    It remembers where its last draft was copied from: while the text since still follows that
    place at least as closely as it follows any other (as long a match of its last tokens), the
    copy goes on from there. Code and documents repeat their lines (`for item in records[`): the
    latest occurrence of the tail may be the previous loop's line, while the copy being made is of
    the line after the one copied last."""

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self.length = 0
        self._copy: tuple[int, int] | None = None  # (where the last draft began, the length then)

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.length]

    def extend(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), dtype=np.int64)
            grown[: self.length] = self._buf[: self.length]
            self._buf = grown
        self._buf[self.length : end] = tokens
        self.length = end

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest n-gram (n <= MAX_N)
        that ends this sequence, within its last SEARCH_TOKENS tokens: the place the last copy
        has reached where its match is that long, else the latest occurrence."""
        t = self.tokens
        n, after = self._latest_match(t)
        if self._copy is not None:
            start, length = self._copy
            here = start + len(t) - length  # where the copy has reached
            if here < len(t) and n > 0 and self._common_tail(t, here) >= n:
                after = here
        if after is None:
            return []
        self._copy = (after, len(t))
        return t[after : after + k].tolist()

    @staticmethod
    def _latest_match(t: np.ndarray) -> tuple[int, int | None]:
        """The longest n <= MAX_N whose last n tokens occurred before, and where the latest such
        occurrence was followed on (0, None where even the last token is new)."""
        end = len(t) - 1  # an occurrence must end before the last token, so that something follows it
        lo = max(0, end - SEARCH_TOKENS)
        for n in range(min(MAX_N, end), 0, -1):
            # match[i]: t[lo + i : lo + i + n] equals the last n tokens (i + n <= end - lo)
            match = t[lo + n - 1 : end] == t[-1]
            for back in range(1, n):
                match &= t[lo + n - 1 - back : end - back] == t[-1 - back]
            hits = np.flatnonzero(match)
            if len(hits):
                return n, lo + int(hits[-1]) + n
        return 0, None

    @staticmethod
    def _common_tail(t: np.ndarray, here: int) -> int:
        """How many tokens (up to MAX_N) before `here` equal the sequence's last ones."""
        m = 0
        while m < min(MAX_N, here) and t[here - 1 - m] == t[-1 - m]:
            m += 1
        return m


class SuffixIndex:
    """Recent finished requests' tokens per tenant, bounded in tokens: n-gram -> (sequence, end)."""

    def __init__(self, capacity: int = SUFFIX_TOKENS) -> None:
        self.capacity = capacity
        self.size = 0
        self._seqs: deque[tuple[int, str | None, list[int]]] = deque()
        self._by_id: dict[int, list[int]] = {}
        self._ends: dict[tuple[str | None, Gram], tuple[int, int]] = {}
        self._next_id = 0

    def add(self, salt: str | None, tokens: list[int]) -> None:
        tokens = tokens[-self.capacity :]
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs.append((sid, salt, tokens))
        self._by_id[sid] = tokens
        self.size += len(tokens)
        for p in range(1, len(tokens)):  # grams followed by something
            for n in range(1, min(MAX_N, p) + 1):
                self._ends[(salt, tuple(tokens[p - n : p]))] = (sid, p)
        while self.size > self.capacity:
            self._evict()

    def lookup(self, salt: str | None, context: list[int], k: int) -> list[int]:
        for n in range(min(MAX_N, len(context)), 0, -1):
            hit = self._ends.get((salt, tuple(context[-n:])))
            if hit is not None:
                sid, end = hit
                return self._by_id[sid][end : end + k]
        return []

    def _evict(self) -> None:
        sid, salt, tokens = self._seqs.popleft()
        del self._by_id[sid]
        self.size -= len(tokens)
        for p in range(1, len(tokens)):
            for n in range(1, min(MAX_N, p) + 1):
                key = (salt, tuple(tokens[p - n : p]))
                if self._ends.get(key, (None, 0))[0] == sid:
                    del self._ends[key]


class Drafter:
    """Proposes drafts for requests in `mode` (one of MODES; "off" proposes nothing)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"speculative must be one of {', '.join(MODES)}; got {mode!r}")
        self.mode = mode
        self._own: dict[str, TokenBuffer] = {}
        self.suffix = SuffixIndex() if mode == "suffix" else None

    def propose(self, r: Request, k: int) -> list[int]:
        """Up to k tokens that may follow r's tokens so far."""
        if self.mode == "off" or k < 1:
            return []
        index = self._own.get(r.request_id)
        if index is None:
            index = self._own[r.request_id] = TokenBuffer()
        missing = r.num_tokens - index.length
        if missing:
            index.extend(r.token_slice(r.num_tokens - missing, r.num_tokens))
        draft = index.lookup(k)
        if not draft and self.suffix is not None:
            draft = self.suffix.lookup(r.cache_salt, index.tokens[-MAX_N:].tolist(), k)
        return draft

    def finished(self, r: Request) -> None:
        """r is over: its index goes, and its text joins the suffix index."""
        self._own.pop(r.request_id, None)
        if self.suffix is not None and r.num_tokens > 1:
            self.suffix.add(r.cache_salt, r.token_slice(max(0, r.num_tokens - SUFFIX_TOKENS), r.num_tokens))

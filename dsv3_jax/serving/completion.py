"""The shortest way to finish a grammar: what a constrained request is forced to write when its token
budget (max_tokens, the context) runs low, so that it ends with a complete match instead of a cut one.

Every byte-level BPE vocabulary has a token per byte, so a completion spelled in single-byte tokens
(plus EOS, which ends a grammar that accepts, and the special tokens a grammar may name) exists when
any does. `Completer.shortest` finds one by breadth-first search over llguidance matcher copies: level
d holds states d tokens away; a state's children are the candidates its grammar allows (where it allows
more than FEW, one per byte class, `_CLASSES`: a letter stands for every letter, so a free string is one
branch, not a hundred); two children of a level with the same next-token mask and acceptance count as
one state, and a level keeps at most BEAM states, BRANCH per parent, taken from each parent in turn. Ties go to the earlier candidate:
EOS, then closing and short-value bytes (`PREFERRED`), so JSON closes with `"`, `}`, `]` and fills a
value with `0`. These cuts may give a
longer completion than the shortest (say "blue" for an enum that also has "red"), never an invalid one.
Where the grammar forces bytes (a keyword, a marker), the one child is the first token llguidance wants
for them (it may insist on that canonical token, "ue" and not "u"); where it allows no candidate
otherwise, its shortest allowed tokens stand in.
"""

from __future__ import annotations

import llguidance
import numpy as np

PREFERRED = b'"}]0:,' + bytes(range(32, 127)) + bytes(range(256))  # candidate bytes, most wanted first
# byte classes whose members lead to alike states; every other byte is a class of its own
_CLASSES = (b"abcdefghijklmnopqrstuvwxyz", b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"123456789", bytes(range(128, 256)),
            bytes(range(32)))
BEAM, BRANCH = 8, 3  # states kept per level, children kept per state
FEW = 32  # allowed candidates up to which every one is tried (an enum's first letters), not one per class
FALLBACK = 4  # shortest allowed tokens tried where no candidate is allowed
DECISIONS = 4  # ways a grammar branches at most where dead ends are looked for
MAX_TRIES = 20_000  # tokens one search may try; past them it reports no completion


def _byte_class(b: int) -> int:
    return next((256 + i for i, members in enumerate(_CLASSES) if b in members), b)


class Completer:
    """The candidate tokens of one vocabulary (EOS, its single-byte tokens, its special tokens), their
    classes, and the byte length and first byte of every token."""

    def __init__(self, lltokenizer: llguidance.LLTokenizer, vocab_size: int, eos_id: int):
        text = [lltokenizer.decode_bytes([t]) for t in range(vocab_size)]
        self.token_bytes_V = np.array([len(b) for b in text], np.int64)
        self._first_V = np.array([b[0] if b else -1 for b in text], np.int64)  # each token's first byte
        candidates = {eos_id: -1}
        for b in dict.fromkeys(PREFERRED):
            ids = lltokenizer.tokenize_bytes(bytes([b]))
            if len(ids) == 1 and lltokenizer.decode_bytes(ids) == bytes([b]):
                candidates.setdefault(ids[0], _byte_class(b))
        self._byte_tokens = {t for t, c in candidates.items() if c >= 0}
        for t in range(vocab_size):
            if lltokenizer.is_special_token(t):
                candidates.setdefault(t, -2 - t)
        self.candidates = np.array(list(candidates), np.int64)
        self.classes = np.array(list(candidates.values()), np.int64)

    def dead_ends(self, matcher: llguidance.LLMatcher, budget: int) -> np.ndarray:
        """Tokens after which no completion fits in `budget` - 1 tokens, where the grammar branches among
        at most DECISIONS ways (after a JSON value: `,` or `}`; after a tool call: another or the end):
        each way's tokens, those that begin with its byte (a special token alone). Empty elsewhere (a
        string's content, where a token opens no structure)."""
        kids = [] if matcher.compute_ff_tokens() else self._allowed(matcher)
        dead = []
        if 2 <= len(kids) <= DECISIONS:
            for token in kids:
                if not matcher.try_consume_tokens([token]):
                    continue
                path, _ = self.shortest(matcher, budget - 1)
                matcher.rollback(1)
                if path is None:
                    same = self._first_V == self._first_V[token]
                    dead.append(np.flatnonzero(same) if token in self._byte_tokens else np.array([token]))
        return np.concatenate(dead) if dead else np.zeros(0, np.int64)

    def _allowed(self, matcher: llguidance.LLMatcher) -> list[int]:
        """The candidates the matcher allows next, the first of each class, in preference order."""
        words_G = np.frombuffer(matcher.compute_bitmask(), np.uint32)
        allowed_V = np.unpackbits(words_G.view(np.uint8), bitorder="little")[:len(self.token_bytes_V)]
        chosen = self.candidates[allowed_V[self.candidates] == 1]
        if len(chosen) > FEW:
            _, first = np.unique(self.classes[allowed_V[self.candidates] == 1], return_index=True)
            chosen = chosen[np.sort(first)]
        if not len(chosen):
            others = np.flatnonzero(allowed_V)
            chosen = others[np.argsort(self.token_bytes_V[others], kind="stable")[:FALLBACK]]
        return chosen.tolist()

    def shortest(self, matcher: llguidance.LLMatcher, limit: int) -> tuple[list[int] | None, int]:
        """(tokens that take `matcher` (left as it is) to the end of its grammar, at most `limit` of them,
        the fewest the search finds, or None; the depth searched): a completion and its length, or None
        and `limit` (less where MAX_TRIES ran out)."""
        if matcher.is_stopped():
            return [], 0
        frontier, tries = [(matcher, [])], 0
        for depth in range(limit):
            children = []  # per state: (token, key) of its distinct children, best first
            for state, path in frontier:
                found, kids = self._children(state)
                tries += len(kids) + (found is not None)
                if found is not None:
                    return path + [found], depth + 1
                children.append(kids)
            frontier = self._beam(frontier, children)
            if not frontier:
                return None, limit
            if tries >= MAX_TRIES:
                return None, depth + 1
        return None, limit

    def _children(self, state: llguidance.LLMatcher) -> tuple[int | None, list]:
        """(a token that ends the grammar, or None; [(token, key)] of the other children, best first, at
        most BRANCH, each key the next-token mask and acceptance)."""
        kids, seen = [], set()
        forced = state.compute_ff_tokens()[:1]  # bytes the grammar forces, in the tokens it wants for them
        for token in forced or self._allowed(state):
            if not state.try_consume_tokens([token]):
                continue
            if state.is_stopped():
                state.rollback(1)
                return token, kids
            key = (state.compute_bitmask(), state.is_accepting())
            if key not in seen and not state.is_error():
                seen.add(key)
                kids.append((token, key))
            state.rollback(1)
            if len(kids) == BRANCH:
                break
        return None, kids

    @staticmethod
    def _beam(frontier: list, children: list[list]) -> list:
        """The next level: the states' children taken in turn (each state's best first) up to BEAM,
        alike ones once."""
        deeper, seen = [], set()
        for rank in range(BRANCH):
            for (state, path), kids in zip(frontier, children):
                if rank < len(kids) and kids[rank][1] not in seen and len(deeper) < BEAM:
                    token, key = kids[rank]
                    seen.add(key)
                    child = state.deep_copy()
                    child.consume_token(token)
                    deeper.append((child, path + [token]))
        return deeper

    def completes(self, matcher: llguidance.LLMatcher, tokens: list[int]) -> bool:
        """Whether `tokens` take `matcher` (left as it is) to the end of its grammar."""
        taken = matcher.try_consume_tokens(tokens) if tokens else 0
        done = taken == len(tokens) and matcher.is_stopped()
        if taken:
            matcher.rollback(taken)
        return done

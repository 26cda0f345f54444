"""Generated ids -> text deltas for streaming, cut at the first stop string.

Incremental: each push decodes only a short window of ids, not the whole continuation (which would
cost O(n^2) over a generation). Byte-level BPE pieces only become characters together, and some
decoders change a token's text by what precedes it (a leading space dropped at the start), so the
window starts a few tokens back: the new text is decode(ids[prefix:]) minus decode(ids[prefix:read])
(the offsets `prefix` <= `read` are those of HF's and vLLM's incremental detokenizers), taken only
once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).

Text is held back while it could still change: that incomplete tail and any suffix that is the
start of a stop string. So a client never receives text that a later token turns into a stop
string, and the emitted deltas concatenate to the final text. `include_stop` ends the text after
the stop string instead of before it (vLLM's `include_stop_str_in_output`); special tokens are left
out of the text unless `skip_special_tokens` is False.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # tokens decoded before the new ones, so that their text reads as in the whole


def held(text: str, markers: list[str]) -> int:
    """Characters at the end of `text` that must wait for more: the longest start of one of `markers`."""
    for n in range(min(max((len(m) for m in markers), default=1) - 1, len(text)), 0, -1):
        if any(text.endswith(m[:n]) for m in markers if len(m) > n):
            return n
    return 0


class TextStream:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.include_stop, self.skip_special_tokens = include_stop, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read] is the window's context; ids[read:] not yet text
        self.sent = 0  # characters of the text already emitted
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self) -> None:
        """Moves the ids that now form whole characters into `text`."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.read = len(self.ids)
            self.prefix = max(self.prefix, self.read - CONTEXT_TOKENS)

    def push(self, ids: list[int]) -> str:
        """Adds generated ids; returns the new text that is safe to emit. Sets `stopped` when the
        text reaches a stop string (the stop string itself is never emitted)."""
        self.ids.extend(ids)
        self._advance()
        text = self.text
        longest = max((len(s) for s in self.stop), default=0)
        since = max(0, self.sent - longest)  # a stop string ending in new text starts at most here
        found = [(at, s) for at, s in ((text.find(s, since), s) for s in self.stop) if at >= 0]
        if found:
            self.stopped = True
            at, stop = min(found, key=lambda f: f[0])
            end = at + len(stop) if self.include_stop else at
        else:
            end = len(text) - held(text, self.stop)  # what could still become a stop string waits
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def finish(self) -> str:
        """The held-back rest once generation has ended without a stop string (an incomplete UTF-8
        tail included, as U+FFFD, as a whole decode would give it)."""
        if self.stopped:
            return ""
        text = self.text + self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]
        delta = text[self.sent:]
        self.sent = len(text)
        return delta

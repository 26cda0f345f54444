"""Generated ids -> text deltas for streaming, cut at the first stop string.

The whole continuation is decoded each time (byte-level BPE pieces only become characters
together). Text is held back while it could still change: a trailing U+FFFD (an incomplete UTF-8
sequence) and any suffix that is the start of a stop string. So a client never receives text that
a later token turns into a stop string, and the emitted deltas concatenate to the final text.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already emitted
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that must wait for more tokens."""
        safe = len(text.rstrip("\ufffd"))
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, safe), hold, -1):
                if text[safe - n:safe] == s[:n]:
                    hold = n
                    break
        return len(text) - safe + hold

    def push(self, ids: list[int]) -> str:
        """Adds generated ids; returns the new text that is safe to emit. Sets `stopped` when the
        text reaches a stop string (the stop string itself is never emitted)."""
        self.ids.extend(ids)
        text = self._text()
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            end = min(cuts)
        else:
            end = len(text) - self._held(text)
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def finish(self) -> str:
        """The held-back rest once generation has ended without a stop string."""
        if self.stopped:
            return ""
        text = self._text()
        delta = text[self.sent:]
        self.sent = len(text)
        return delta

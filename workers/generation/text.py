"""Generated text, token by token: incremental detokenisation that never splits a UTF-8 character, and
stop strings that are cut off and never streamed.

Detokenising (vLLM's offsets): a token may hold part of a character (byte-level BPE splits an emoji over
several tokens), so text is released only once the decoded window no longer ends in U+FFFD. The window
starts a few tokens back so a tokenizer that drops or adds a leading space at the start of a decode
sees the same context as in the whole text; each step decodes a handful of tokens, not the whole text.

Stop strings: the text that could still become a stop string (a suffix that is a prefix of one) is held
back; when a stop string completes, the text ends just before it.
"""

from __future__ import annotations

from typing import Any, Protocol

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: Decoder | Any, prompt: list[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token: int) -> str:
        """The text `token` completes (often "" while a character is still partial)."""
        self._ids.append(token)
        before = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        now = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]


class StopText:
    """The generated text so far, what of it may be sent, and whether a stop string ended it."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self.text = ""  # everything released (never past a stop string)
        self._sent = 0
        self.stopped = False

    def add(self, delta: str) -> str:
        """Takes new text; returns what may be sent now."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self._stops), default=0))
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self.flush()
        hold = max((n for s in self._stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        end = len(self.text) - hold
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def flush(self) -> str:
        """The held-back rest (the generation ended)."""
        out = self.text[self._sent:]
        self._sent = len(self.text)
        return out

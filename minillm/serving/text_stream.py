"""Text as it streams: each event carries the text its token added, decoded from all the tokens so far.

So the events concatenate to exactly the decoded completion. A token that ends
inside a UTF-8 character, or text that may be the start of a stop string, is
held back until the next token settles it; its event then carries "" (so a
client can still time every token).
"""
from __future__ import annotations

from typing import Callable


class TextStream:
    """One completion's text, delta by delta: decode every token so far, hand out only what is settled.

    Held back: a trailing U+FFFD (the token ended inside a UTF-8 character) and a tail that may be the start
    of a stop string. A stop string ends the text before it, as in the OpenAI API.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.sent = 0        # characters handed out
        self.stopped = False  # a stop string was found

    def update(self, token_ids: list[int], finished: bool) -> str:
        text = self.decode(token_ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.stopped, finished = text[:min(hits)], True, True
        end = len(text)
        if not finished:
            if text.endswith("\ufffd"):
                end -= 1
            for k in range(min(end, max((len(s) for s in self.stops), default=1) - 1), 0, -1):
                if any(s.startswith(text[end - k:end]) for s in self.stops):
                    end -= k
                    break
        end = max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta

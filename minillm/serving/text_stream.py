"""Text as it streams: each event carries the text its token added, decoded incrementally.

The events concatenate to exactly the decoded completion. A token that ends
inside a UTF-8 character, or text that may be the start of a stop string, is
held back until the next token settles it; its event then carries "" (so a
client can still time every token).

What each token costs, however long the text and however many stop strings:

    decode      only the tokens not yet settled (those since the last whole character),
                not the whole completion again: O(new tokens)
    stop match  one automaton over all the stop strings (Aho–Corasick), fed only the new
                characters: O(new characters), whatever the number of stop strings

The automaton's state after a character is the longest tail of the text that
is the start of some stop string: exactly the text to hold back. A stop string
ends the text before it, as in the OpenAI API: after each token whose text is
settled, the text is cut where the earliest stop string found in it starts.
"""
from __future__ import annotations

from collections import deque
from typing import Callable


class StopStrings:
    """An Aho–Corasick automaton over the stop strings: built once per request (O(total characters)), shared by
    its samples, never changed after."""

    def __init__(self, stops: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]       # characters from the root: the length of the prefix a state stands for
        self.fail = [0]
        self.match = [0]       # the longest stop string ending at this state (itself or along its fail links)
        for s in stops:
            state = 0
            for ch in s:
                if ch not in self.goto[state]:
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.fail.append(0)
                    self.match.append(0)
                    self.goto[state][ch] = len(self.goto) - 1
                state = self.goto[state][ch]
            if s:
                self.match[state] = len(s)
        order = deque(self.goto[0].values())
        while order:  # breadth first: a state's fail link is shallower, so already done
            state = order.popleft()
            for ch, child in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0) if self.goto[f].get(ch, 0) != child else 0
                self.match[child] = max(self.match[child], self.match[self.fail[child]])
                order.append(child)

    def feed(self, state: int, text: str) -> tuple[int, int | None]:
        """Run `text` from `state`: (the state after, where the earliest stop string found in it starts, counted
        from the start of `text`: negative if it began in the text before, None if none ends in `text`)."""
        goto, fail, match, first = self.goto, self.fail, self.match, None
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state] and (first is None or i + 1 - match[state] < first):
                first = i + 1 - match[state]
        return state, first


class TextStream:
    """One completion's text, delta by delta: decode the new tokens, hand out only what is settled.

    Held back: a trailing U+FFFD (the token ended inside a UTF-8 character) and a tail that may be the start
    of a stop string. `update` takes every token id so far; only those since the last settled one are decoded.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | StopStrings):
        self.decode = decode
        self.stops = stops if isinstance(stops, StopStrings) else StopStrings([s for s in stops if s])
        self.text = ""        # decoded text of the settled tokens, stop-string matched
        self.read = 0         # tokens whose text is in self.text
        self.state = 0        # the automaton's state after self.text
        self.sent = 0         # characters handed out
        self.stopped = False  # a stop string was found

    def update(self, token_ids: list[int], finished: bool) -> str:
        if self.stopped:
            return ""
        new = self.decode(token_ids[self.read:])
        whole = finished or not new.endswith("\ufffd")
        if whole:  # settled: every character complete (or nothing more will come)
            self.read = len(token_ids)
            self.state, start = self.stops.feed(self.state, new)
            if start is not None:
                self.text, self.stopped, finished = (self.text + new)[:len(self.text) + start], True, True
            else:
                self.text += new
        end = len(self.text)
        if not finished:
            end -= self.stops.depth[self.state]  # may be the start of a stop string
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta

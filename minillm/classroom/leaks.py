"""The leak check: no run of a solution's tokens in anything a copy holds."""
from __future__ import annotations

import io
import keyword
import re
import textwrap
import tokenize
from pathlib import Path

from .regions import PACKAGE, Exercise

LEAK_TOKENS = 8          # this many consecutive tokens of a solution, names and spacing aside, is a leak...
LEAK_SPECIFIC = 3        # ...when at least this many of them are specific (not a name, string, comma, bracket,
                         # dot or `=`), one of them not a keyword: `f(a, b, c):` is the shape of any line
LEAK_SPECIFIC_CODE = 4   # ...and this many in code, where loops over a range and a tensor's shape are everyday lines
LEAK_COPY = 16           # this many consecutive tokens of a solution are a copy, even of idioms the package shows
_PLAIN = {"n", "s", ",", "(", ")", "[", "]", ".", "="}
_TOKEN = re.compile(r"[^\W\d]\w*|\d+(?:\.\d+)?|\*\*|//|->|:=|[-+*/%@&|^<>=!]=|\.\.\.|[^\s\w]")
_MATH = str.maketrans({"·": "*", "×": "*", "−": "-", "≤": "<=", "≥": ">=", "≠": "!=", "÷": "/"})
_IGNORED = {"{", "}", "'", '"', "`", "#"}   # f-string braces, quotes and comment signs carry no code


def code_tokens(text: str) -> list[str]:
    """`text` as normalised tokens: every name one chooses is `n`, math signs become Python's, and spacing,
    quotes and braces go; keywords and attributes (`.values`, `.popleft`: the API, not a choice) stay.
    `a[i // w] * w` and `rows[j // size] · size` are the same 8 tokens."""
    return [tok for tok, _ in _normalised([(1, text)])]


def _normalised(pieces: list[tuple[int, str]]) -> list[tuple[str, int]]:
    """code_tokens of consecutive pieces of text, each token with the line of its piece."""
    out: list[tuple[str, int]] = []
    for line, piece in pieces:
        for tok in _TOKEN.findall(piece.translate(_MATH)):
            if tok in _IGNORED:
                continue
            is_name = tok[0].isalpha() or tok[0] == "_"
            out.append(("n" if is_name and not keyword.iskeyword(tok) and not (out and out[-1][0] == ".") else tok,
                        line))
    return out


def _specific(gram: tuple[str, ...], at_least: int = LEAK_SPECIFIC) -> bool:
    keywords = sum(keyword.iskeyword(tok) for tok in gram)
    others = sum(tok not in _PLAIN and not keyword.iskeyword(tok) for tok in gram)
    return others >= 1 and keywords + others >= at_least


def _code_only(code: str) -> list[str]:
    """Python code as normalised tokens, without its comments, and each string as one token `s`: what a
    solution *does* is in its code; the prose of its error messages is no more a leak than any sentence."""
    return [tok for tok, _ in _code_with_lines(code)]


def _code_with_lines(code: str) -> list[tuple[str, int]]:
    """_code_only's tokens, each with its line."""
    try:
        kept = [(t.start[0], "s" if t.type == tokenize.STRING else t.string)
                for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        kept = [(n, re.sub(r"#.*", "", line)) for n, line in enumerate(code.splitlines(), 1)]
    return _normalised(kept)


def _prose_of_python(text: str, skip_lines: set[int]) -> list[tuple[int, str]]:
    """(line, text) of every comment and string in a Python source, outside `skip_lines` (1-based)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return list(enumerate(text.splitlines(), 1))
    return [(t.start[0], t.string) for t in tokens
            if t.type in (tokenize.COMMENT, tokenize.STRING) and t.start[0] not in skip_lines]


def find_leaks(root: Path, exercises: list[Exercise], files: list[str],
               written: dict[str, str] | None = None) -> list[str]:
    """Where LEAK_TOKENS consecutive tokens of an exercise's solution appear in `files`, all that a copy holds: the
    code and the prose (comments, hints, docstrings, messages) of the package and the tests, the lessons, the
    READMEs and every other text file. Each leak as 'file:line: exercise <id>: <the tokens>'.

    A run that the package's own code outside the regions shows anyway (`float("-inf")`, a torch call's usual
    arguments) is an idiom, not an answer, and counts only as part of a longer copy: LEAK_COPY consecutive tokens
    of a solution are a leak in any file but the package's code. Only the package's code makes idioms: a test
    that holds a solution does not excuse itself, nor another test. In code, a run needs LEAK_SPECIFIC_CODE
    specific tokens, since everyday lines (a loop over a range, a tensor's size) belong to no solution.
    `written`: the prose of files that `make` writes itself (file -> text), read as lines."""
    bodies: dict[str, set[int]] = {}
    for ex in exercises:   # the regions' code leaves the copy; their hints and markers stay
        bodies.setdefault(ex.file, set()).update(range(ex.line + 2, ex.line + 2 + len(ex.body)))
    streams: list[tuple[str, list[tuple[str, int]], str]] = []   # (file, tokens, "idioms" | "code" | "prose")
    for rel in files:
        text = _text_of(root / rel)
        if text is None:
            continue
        if rel.endswith(".py") and not rel.startswith("lessons/"):   # code and prose apart: a string is one token
            code = "\n".join("" if n in bodies.get(rel, ()) else line for n, line in enumerate(text.splitlines(), 1))
            streams.append((rel, _code_with_lines(code), "idioms" if rel.startswith(PACKAGE + "/") else "code"))
            streams.append((rel, _normalised(_split(_prose_of_python(text, bodies.get(rel, set())))), "prose"))
        else:   # read whole: lessons are code the student runs, and prose may hold code
            streams.append((rel, _normalised(list(enumerate(text.splitlines(), 1))), "prose"))
    streams += [(rel, _normalised(list(enumerate(text.splitlines(), 1))), "prose")
                for rel, text in (written or {}).items()]
    given = {tuple(tok for tok, _ in tokens[i:i + LEAK_TOKENS])
             for _, tokens, kind in streams if kind == "idioms" for i in range(len(tokens) - LEAK_TOKENS + 1)}
    grams: dict[tuple[str, ...], tuple[str, bool]] = {}   # a solution's LEAK_TOKENS-grams, idioms aside: (id, in code)
    copies: dict[tuple[str, ...], str] = {}               # a solution's LEAK_COPY-grams
    for ex in exercises:
        tokens = _code_only(textwrap.dedent("\n".join(ex.body)) + "\n")
        for i in range(len(tokens) - LEAK_TOKENS + 1):
            gram = tuple(tokens[i:i + LEAK_TOKENS])
            if gram not in given and _specific(gram):
                grams.setdefault(gram, (ex.id, _specific(gram, LEAK_SPECIFIC_CODE)))
            if i + LEAK_COPY <= len(tokens) and _specific(tuple(tokens[i:i + LEAK_COPY])):
                copies.setdefault(tuple(tokens[i:i + LEAK_COPY]), ex.id)
    leaks, reported = [], set()
    for rel, flat, kind in streams:
        if kind == "idioms":   # the package's own code: what it shows, it shows anyway
            continue
        for i in range(len(flat) - LEAK_TOKENS + 1):
            ex_id, in_code = grams.get(tuple(tok for tok, _ in flat[i:i + LEAK_TOKENS]), (None, False))
            width = LEAK_TOKENS
            if kind == "code" and not in_code:
                ex_id = None
            if ex_id is None and i + LEAK_COPY <= len(flat):   # a copy of idioms is still a copy
                ex_id, width = copies.get(tuple(tok for tok, _ in flat[i:i + LEAK_COPY])), LEAK_COPY
            if ex_id and (rel, flat[i][1], ex_id) not in reported:
                reported.add((rel, flat[i][1], ex_id))
                leaks.append(f"{rel}:{flat[i][1]}: exercise {ex_id}: "
                             f"{' '.join(tok for tok, _ in flat[i:i + width])}")
    return leaks


def _text_of(path: Path) -> str | None:
    """A file's text, or None for one that is not text (weights, images)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _split(pieces: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Pieces of prose split into lines, so that a sequence over two lines of a docstring is seen, at its line."""
    return [(line + offset, part) for line, text in pieces for offset, part in enumerate(text.splitlines() or [""])]

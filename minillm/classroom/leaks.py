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
_PLAIN = {"n", "s", ",", "(", ")", "[", "]", ".", "="}
_TOKEN = re.compile(r"[^\W\d]\w*|\d+(?:\.\d+)?|\*\*|//|->|:=|[-+*/%@&|^<>=!]=|\.\.\.|[^\s\w]")
_MATH = str.maketrans({"·": "*", "×": "*", "−": "-", "≤": "<=", "≥": ">=", "≠": "!=", "÷": "/"})
_IGNORED = {"{", "}", "'", '"', "`", "#"}   # f-string braces, quotes and comment signs carry no code


def code_tokens(text: str) -> list[str]:
    """`text` as normalised tokens: every name one chooses is `n`, math signs become Python's, and spacing,
    quotes and braces go; keywords and attributes (`.values`, `.popleft`: the API, not a choice) stay.
    `a[i // w] * w` and `rows[j // size] · size` are the same 8 tokens."""
    out: list[str] = []
    for tok in _TOKEN.findall(text.translate(_MATH)):
        if tok in _IGNORED:
            continue
        is_name = tok[0].isalpha() or tok[0] == "_"
        out.append("n" if is_name and not keyword.iskeyword(tok) and not (out and out[-1] == ".") else tok)
    return out


def _specific(gram: tuple[str, ...]) -> bool:
    keywords = sum(keyword.iskeyword(tok) for tok in gram)
    others = sum(tok not in _PLAIN and not keyword.iskeyword(tok) for tok in gram)
    return others >= 1 and keywords + others >= LEAK_SPECIFIC


def _code_only(code: str) -> list[str]:
    """Python code as normalised tokens, without its comments, and each string as one token `s`: what a
    solution *does* is in its code; the prose of its error messages is no more a leak than any sentence."""
    try:
        kept = [("s" if t.type == tokenize.STRING else t.string)
                for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        kept = [re.sub(r"#.*", "", code)]
    return code_tokens(" ".join(kept))


def _prose_of_python(text: str, skip_lines: set[int]) -> list[tuple[int, str]]:
    """(line, text) of every comment and string in a Python source, outside `skip_lines` (1-based)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return list(enumerate(text.splitlines(), 1))
    return [(t.start[0], t.string) for t in tokens
            if t.type in (tokenize.COMMENT, tokenize.STRING) and t.start[0] not in skip_lines]


def find_leaks(root: Path, exercises: list[Exercise], files: list[str]) -> list[str]:
    """Where LEAK_TOKENS consecutive tokens of an exercise's solution appear in what a student reads of `files`:
    the comments, hints, docstrings and messages of the package and the tests, the lessons, and the READMEs.
    Each leak as 'file:line: exercise <id>: <the tokens>'."""
    bodies: dict[str, set[int]] = {}
    for ex in exercises:   # the regions' code leaves the copy; their hints and markers stay
        bodies.setdefault(ex.file, set()).update(range(ex.line + 2, ex.line + 2 + len(ex.body)))
    given: set[tuple[str, ...]] = set()   # sequences the copy's own code shows anyway: idioms, not answers
    for rel in files:
        if rel.startswith(PACKAGE + "/") and rel.endswith(".py"):
            lines = (root / rel).read_text(encoding="utf-8").splitlines()
            tokens = _code_only("\n".join("" if n in bodies.get(rel, ()) else line for n, line in enumerate(lines, 1)))
            given.update(tuple(tokens[i:i + LEAK_TOKENS]) for i in range(len(tokens) - LEAK_TOKENS + 1))
    grams: dict[tuple[str, ...], str] = {}
    for ex in exercises:
        tokens = _code_only(textwrap.dedent("\n".join(ex.body)) + "\n")
        for i in range(len(tokens) - LEAK_TOKENS + 1):
            gram = tuple(tokens[i:i + LEAK_TOKENS])
            if gram not in given and _specific(gram):
                grams.setdefault(gram, ex.id)
    if not grams:
        return []
    texts: list[tuple[str, int, str]] = []
    for rel in files:
        if not rel.endswith((".py", ".md")):
            continue
        text = (root / rel).read_text(encoding="utf-8")
        if rel.endswith(".md") or rel.startswith("lessons/"):   # read whole: lessons are code the student runs
            texts += [(rel, n, line) for n, line in enumerate(text.splitlines(), 1)]
        else:
            texts += [(rel, n, piece) for n, piece in _prose_of_python(text, bodies.get(rel, set()))]
    leaks = []
    for rel, start_line, text in _joined_by_file(texts):
        tokens = [(code_tokens(piece), line) for line, piece in text]
        flat = [(tok, line) for toks, line in tokens for tok in toks]
        reported: set[tuple[int, str]] = set()
        for i in range(len(flat) - LEAK_TOKENS + 1):
            ex_id = grams.get(tuple(tok for tok, _ in flat[i:i + LEAK_TOKENS]))
            if ex_id and (flat[i][1], ex_id) not in reported:
                reported.add((flat[i][1], ex_id))
                leaks.append(f"{rel}:{flat[i][1]}: exercise {ex_id}: "
                             f"{' '.join(tok for tok, _ in flat[i:i + LEAK_TOKENS])}")
    return leaks


def _joined_by_file(texts: list[tuple[str, int, str]]):
    """Each file's pieces in order, so a sequence split over two lines of a docstring is still seen."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for rel, line, text in texts:
        for offset, piece in enumerate(text.splitlines() or [""]):
            by_file.setdefault(rel, []).append((line + offset, piece))
    return [(rel, pieces[0][0] if pieces else 1, pieces) for rel, pieces in by_file.items()]



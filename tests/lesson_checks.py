"""What every lesson's results must show, checked on each lesson's quick run:

- one number per quantity: every number printed in a check's verdict line, and in the plot's titles, is a value
  of the results file, at the precision it was printed with (a percentage, milliseconds or an SI prefix count
  as the same value);
- a NOT SUPPORTED is explained: every check carries a `why` computed from the run (it holds a number), and
  every check that is NOT SUPPORTED prints it;
- the prediction, the thread count and its reason are in the results file.
"""
import math
import re

NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)")
SCALES = (1, 100, 1e3, 1e6, 1e-3, 1e-6, 1e-9, 1e-12)  # as is, %, ms, µs, k, M, G, T


def numbers_in(doc, skip=("reasons", "plot_titles", "command", "predictions")) -> list[float]:
    """Every number in the results file (strings and the printed lines left out)."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k not in skip:
                    walk(v)
        elif isinstance(x, list):
            out.append(float(len(x)))  # "over 5 rounds": a count of a list's values
            for v in x:
                walk(v)
        elif isinstance(x, bool):
            return
        elif isinstance(x, (int, float)) and math.isfinite(x):
            out.append(float(x))
    walk(doc)
    return out


def matches(token: str, values: list[float]) -> bool:
    """Does some value, at some scale, print as `token` at the token's precision?"""
    decimals = len(token.split(".")[1]) if "." in token else 0
    target = token.replace(",", "")
    for v in values:
        for s in SCALES:
            x = v * s
            if f"{x:.{decimals}f}" == target or (decimals == 0 and f"{x:.0f}" == target):
                return True
    return False


def printed_numbers(text: str) -> list[str]:
    text = re.sub(r"\d{4}-\d\d-\d\d", "", text)  # no dates
    text = re.sub(r"(?i)gpt2-?\w*|\bp(50|90|99)\b|\b[a-z]+\d+\b", "", text)  # names with digits, percentiles
    return NUMBER.findall(text)


def assert_one_number_per_quantity(doc: dict) -> None:
    values = numbers_in(doc)
    names = {c["name"] for c in doc["verdict"]["checks"]}
    lines = [r for r in doc["verdict"]["reasons"] if any(r.startswith(n) for n in names)]
    assert lines, doc["verdict"]["reasons"]
    assert doc["plot_titles"], "the plot's titles are kept in the results file"
    unknown = [(t, line) for line in lines + doc["plot_titles"] for t in printed_numbers(line)
               if not matches(t, values)]
    assert not unknown, f"{doc['lesson']}: printed numbers that are no value of its results file: {unknown}"


def assert_explained(doc: dict) -> None:
    v = doc["verdict"]
    for c in v["checks"]:
        assert c["why"] and re.search(r"\d", c["why"]), f"{doc['lesson']}: check {c['name']!r} has no computed why"
        if c["outcome"] == "NOT SUPPORTED":
            assert any(r.startswith(f"why ({c['name']})") and c["why"] in r for r in v["reasons"]), v["reasons"]
    assert v["outcome"] in ("HOLDS", "NOT SUPPORTED", "INCONCLUSIVE")
    label = {"HOLDS": "CLAIM HOLDS", "NOT SUPPORTED": "CLAIM NOT SUPPORTED", "INCONCLUSIVE": "INCONCLUSIVE"}
    assert doc["plot_titles"][0].startswith(label[v["outcome"]]), "the verdict is the plot's title"
    t = doc["threads"]
    assert t["threads"] >= 1 and t["reason"] and t["cpus"] >= 1


def assert_lesson_results(doc: dict) -> None:
    assert_explained(doc)
    assert_one_number_per_quantity(doc)

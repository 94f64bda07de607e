"""What every lesson's results must show, checked on each lesson's quick run:

- one number per quantity: every number printed in a check's verdict line, and in the plot's titles, is a value
  of the results file, at the precision it was printed with (a percentage, milliseconds or an SI prefix count
  as the same value);
- a NOT SUPPORTED is explained: every check carries a `why` computed from the run (it holds a number), and
  every check that is NOT SUPPORTED prints it;
- predict, then measure: every check carries the cost model's `predicted` value and its measured ÷ predicted
  (median and interval, each the check's own over the prediction); a figure with no prediction is a fact
  (`verdict.facts`), never a check; the student's predictions (`--predict`) name checks;
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


def assert_predicted(doc: dict) -> None:
    """Every check has a prediction, and measured ÷ predicted is its median and interval over it (null for a
    prediction of 0: a count that must be 0); the lesson's and the student's predictions are recorded by key."""
    v, lesson = doc["verdict"], doc["lesson"]
    keys = [c["key"] for c in v["checks"]]
    assert len(set(keys)) == len(keys), f"{lesson}: check keys repeat: {keys}"
    for c in v["checks"]:
        p, ratio = c["predicted"], c["measured_over_predicted"]
        assert p is not None, (f"{lesson}: check {c['name']!r} has no prediction: give it predicted= (the cost model's "
                               "value on this machine) or, if it cannot refute the claim, report it as a Fact")
        if p == 0:
            assert ratio is None, f"{lesson}: {c['name']!r}: no ratio over a prediction of 0"
            continue
        lo, hi = sorted(x / p for x in c["interval"])
        assert ratio is not None and [round(x, 9) for x in ratio] == [round(x, 9) for x in (c["median"] / p, lo, hi)], \
            f"{lesson}: {c['name']!r}: measured ÷ predicted {ratio} is not (median, lo, hi) ÷ {p}"
    assert doc["lesson_predictions"] == {c["key"]: c["predicted"] for c in v["checks"]}
    assert set(doc["student_predictions"]) <= set(keys), f"{lesson}: a student prediction names no check"
    for f in v["facts"]:
        assert f["measured_over_predicted"] == (f["value"] / f["predicted"] if f["predicted"] else None), f


def assert_lesson_results(doc: dict) -> None:
    assert_explained(doc)
    assert_one_number_per_quantity(doc)
    assert_predicted(doc)

"""What every lesson shares: its flags, its setup, its table, its results file and its plot.

Every lesson runs the same way:

    python lessons/NN_name.py [--model gpt2] [--device auto] [--dtype auto] [--quick] [--out lessons/results]

and leaves two files in `--out`: `NN_name.json` (the environment, the measured
ceilings and every figure the lesson printed) and `NN_name.png` (its plot).
`--quick` picks small sizes that finish in seconds on a CPU; the tests use it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, never a window: lessons run headless and in tests
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from minillm.metrics import Ceilings, environment, measure_ceilings, si  # noqa: E402
from minillm.weights import load_model, resolve_device, resolve_dtype  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "lessons" / "results"


def make_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every lesson takes; a lesson may add its own to the returned parser."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2",
                        help="preset name or checkpoint folder (default gpt2; random init when weights are absent)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, fp16, bf16")
    parser.add_argument("--quick", action="store_true", help="small sizes that finish in seconds on a CPU")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"results folder (default {DEFAULT_OUT})")
    return parser


@dataclass
class Lesson:
    """A lesson's run: what it measures on, and where its results go."""
    name: str
    args: argparse.Namespace
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    ceilings: Ceilings
    out: Path
    started: float

    @property
    def config(self):
        return self.model.config


def start(name: str, args: argparse.Namespace) -> Lesson:
    """Resolve device and dtype, load the model, measure this device's ceilings, print them."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    started = time.perf_counter()
    model = load_model(args.model, device, dtype)
    ceilings = measure_ceilings(device, dtype, quick=args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lesson = Lesson(name, args, model, device, dtype, ceilings, out, started)
    print(f"== {name} ==  model {args.model} ({model.weights_source}), {ceilings.device}, {ceilings.dtype}"
          f"{', quick' if args.quick else ''}")
    line = (f"measured ceilings: matmul {si(ceilings.matmul_flops, 'FLOP/s')}, copy bandwidth "
            f"{si(ceilings.bandwidth, 'B/s')}, ridge {ceilings.ridge:.1f} FLOP/B")
    if ceilings.datasheet:
        d = ceilings.datasheet
        line += f"   [{d['source']}: {si(d['matmul_flops'], 'FLOP/s')}, {si(d['bandwidth'], 'B/s')}]"
    print(line + "\n")
    return lesson


def ms(seconds: float) -> str:
    """A duration for tables: milliseconds below a second, seconds above."""
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def print_table(headers: list[str], rows: list[list], title: str = "") -> None:
    """A plain aligned table; cells are shown with str()."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print()


def print_verdict(verdict: dict) -> None:
    label = "CLAIM HOLDS" if verdict["holds"] else "CLAIM NOT SUPPORTED BY THIS RUN"
    print(f"Verdict: {label}\n  " + "\n  ".join(verdict["reasons"]) + "\n")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def command_line(lesson: Lesson) -> str:
    """The command that reruns this lesson, rebuilt from its parsed flags (whether it ran from a shell or a test)."""
    parts = ["python", f"lessons/{lesson.name}.py"]
    for key, value in vars(lesson.args).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not False and value is not None:
            parts += [flag, str(value)]
    return " ".join(parts)


def write_results(lesson: Lesson, figures: dict, verdict: dict) -> Path:
    """`<out>/<name>.json`: environment, model, ceilings, every figure and the verdict."""
    doc = {
        "lesson": lesson.name,
        "command": command_line(lesson),
        "quick": lesson.args.quick,
        "model": lesson.args.model,
        "weights_source": lesson.model.weights_source,
        "environment": environment(lesson.device, lesson.dtype),
        "ceilings": lesson.ceilings.as_dict(),
        "figures": figures,
        "verdict": verdict,
        "wall_s": time.perf_counter() - lesson.started,
    }
    path = lesson.out / f"{lesson.name}.json"
    path.write_text(json.dumps(_jsonable(doc), indent=2) + "\n")
    print(f"results: {path}")
    return path


def save_plot(lesson: Lesson, fig) -> Path:
    path = lesson.out / f"{lesson.name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot:    {path}")
    return path


def plot_roofline(ax, ceilings: Ceilings, groups: dict[str, tuple[list[float], list[float]]]) -> None:
    """A roofline on log-log axes: the roof min(peak, I·bandwidth), and groups of (intensity, FLOP/s) points."""
    xs = [x for pts in groups.values() for x in pts[0]] + [ceilings.ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.loglog(grid, [ceilings.attainable(i) for i in grid], "k-", label="measured roofline")
    ax.axvline(ceilings.ridge, color="grey", ls=":", label=f"ridge {ceilings.ridge:.1f} FLOP/B")
    for (label, (intensity, flops)), marker in zip(groups.items(), "os^dv"):
        ax.loglog(intensity, flops, marker, label=label)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.legend(fontsize=8)


__all__ = ["make_parser", "start", "Lesson", "si", "ms", "print_table", "print_verdict", "write_results",
           "save_plot", "plot_roofline", "plt", "DEFAULT_OUT", "REPO_ROOT"]

"""What every lesson shares: its flags, its setup, its table, its results file, its plot, and its exit.

Every lesson runs the same way:

    python lessons/NN_name.py [--model gpt2] [--device auto] [--dtype auto] [--quick] [--out lessons/results]

and leaves two files in `--out`: `NN_name.json` (the environment, the machine's
load, every figure the lesson printed and its verdict) and `NN_name.png` (its
plot). `--quick` picks sizes that finish in seconds on a CPU and still judge
the claim. The sibling modules hold the rest of the shared code: `measure.py`
(timing in turns, the machine's load, checks and the verdict) and
`workloads.py` (request traces and replaying them through the engine).

A lesson that reaches an exercise still to be written (in a student copy)
stops with one line that names it, says where it is and how to check it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, never a window: lessons run headless and in tests
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

from measure import MachineLoad, Verdict, read_load  # noqa: E402
from minillm.classroom.regions import stub_of  # noqa: E402  (the one stub detector)
from minillm.config import HF_CHECKPOINTS, PRESETS  # noqa: E402
from minillm.cli_flags import add_model_arguments  # noqa: E402
from minillm.roofline import Ceilings, measure_ceilings  # noqa: E402
from minillm.timing import environment, si  # noqa: E402
from minillm.weights import load_model, locate, random_model, resolve_device, resolve_dtype  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "lessons" / "results"
STUB_EXIT = 3  # exit status of a lesson that stopped at an exercise still to be written


def make_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every lesson takes; `--help` shows the lesson's whole docstring."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, weights_dir=False)
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
    ceilings: Ceilings | None
    out: Path
    started: object  # measure.LoadReading at the start

    @property
    def config(self):
        return self.model.config

    def load(self) -> MachineLoad:
        """The machine's load from the start of the lesson until now."""
        return MachineLoad.between(self.started, read_load())


def quiet_load_model(name: str, device, dtype):
    """load_model, with a one-line note instead of a banner when the weights are not downloaded."""
    folder, preset = locate(name)
    if preset is None or folder.is_dir() or preset not in HF_CHECKPOINTS:
        return load_model(name, device, dtype)
    if not os.environ.get("MINILLM_LESSONS_WEIGHTS_NOTE_SHOWN"):  # run_all.py said it once for every lesson
        print(f"(no weights in {folder}: a seeded random init of the {preset} shape; times and bytes do not depend "
              f"on the values. `python weights_download.py {preset}` fetches the real ones)")
    return random_model(PRESETS[preset], device, dtype)


def start(name: str, args: argparse.Namespace, ceilings: bool = True) -> Lesson:
    """Resolve device and dtype, load the model, read the machine's load, and measure the device's ceilings."""
    started = read_load()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = quiet_load_model(args.model, device, dtype)
    ceil = measure_ceilings(device, dtype, quick=args.quick) if ceilings else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lesson = Lesson(name, args, model, device, dtype, ceil, out, started)
    print(f"== {name} ==  model {args.model} ({model.weights_source}), {device}, {str(dtype).removeprefix('torch.')}"
          f"{', quick' if args.quick else ''}")
    if ceil is not None:
        line = (f"measured ceilings: matmul {si(ceil.matmul_flops, 'FLOP/s')}, copy bandwidth "
                f"{si(ceil.bandwidth, 'B/s')}, ridge {ceil.ridge:.1f} FLOP/B")
        if ceil.datasheet:
            d = ceil.datasheet
            line += f"   [{d['source']}: {si(d['matmul_flops'], 'FLOP/s')}, {si(d['bandwidth'], 'B/s')}]"
        print(line)
    print()
    return lesson


@contextlib.contextmanager
def one_thread():
    """Run a model of tiny matrices on one thread: its kernels gain nothing from more, and on shared cores
    the extra threads only wait for each other (30× slower on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def write_results(lesson: Lesson, figures: dict, verdict: Verdict) -> Path:
    """`<out>/<name>.json`: environment, model, ceilings, every figure, the verdict and the wall time."""
    doc = {
        "lesson": lesson.name,
        "command": command_line(lesson),
        "quick": lesson.args.quick,
        "model": lesson.args.model,
        "weights_source": lesson.model.weights_source,
        "environment": environment(lesson.device, lesson.dtype),
        "ceilings": lesson.ceilings.as_dict() if lesson.ceilings else None,
        "figures": figures,
        "verdict": verdict.as_dict(),
        "wall_s": time.perf_counter() - lesson.started.wall,
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


def ticks_at(ax, values, axis: str = "x") -> None:
    """Ticks exactly at `values`, labelled plainly (1, 2, 4, 8), also on a log axis."""
    values = sorted(set(values))
    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(FixedLocator(values))
    a.set_minor_locator(NullLocator())
    a.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{v:g}" for v in values]))


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


def run(main) -> None:
    """Run a lesson's main(); at an exercise still to be written, stop with one line instead of a traceback."""
    try:
        main()
    except NotImplementedError as e:
        exercise = stub_of(e)
        if exercise is None:
            raise
        frame = traceback.extract_tb(e.__traceback__)[-1]
        path = Path(frame.filename).resolve()
        where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        print(f"stopped: this lesson needs exercise {exercise}, still to be written at {where}:{frame.lineno}, "
              f"in {frame.name}; write it, then run `python -m minillm.classroom check {exercise}`",
              file=sys.stderr)
        sys.exit(STUB_EXIT)


__all__ = ["make_parser", "start", "Lesson", "si", "ms", "print_table", "write_results", "save_plot", "ticks_at",
           "plot_roofline", "run", "one_thread", "plt", "DEFAULT_OUT", "REPO_ROOT", "STUB_EXIT"]

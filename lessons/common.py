"""What every lesson shares: its flags, its setup, its table, its results file, its plot, and its exit.

Every lesson runs the same way:

    python lessons/NN_name.py [--model gpt2] [--device auto] [--dtype auto] [--quick] [--threads N]
                              [--predict NAME=VALUE ...] [--out lessons/results]

and leaves two files in `--out`: `NN_name.json` (the environment, the machine's
load, the thread count and why, every figure the lesson printed and its
verdict) and `NN_name.png` (its plot, the verdict in its title). Torch gets
one thread per core that is free when the lesson starts (`minillm/bench/threads.py`):
two threads that share one free core wait for each other at every barrier.
`--quick` picks sizes that finish in seconds on a CPU and still judge
the claim.

Predict, then measure: before it measures, a lesson prints its prediction,
one line per check: the check's key and the value its cost model gives on
this machine's measured ceilings (`predict`). `--predict KEY=VALUE` enters
your own first; the results file keeps it (`student_predictions`) beside the
lesson's, and the run prints both beside the measured value.

The measuring wing holds the rest: `minillm/bench/verdict.py` (checks,
facts and the verdict), `rounds.py` (timing in turns), `load.py` (the
machine's load), `workloads.py` (the traces) and `replay.py` (serving a trace
through the engine).

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
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

import minillm  # noqa: E402,F401  (before torch: idle threads sleep, `minillm.let_idle_threads_sleep` says why)
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, never a window: lessons run headless and in tests
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from minillm.bench.verdict import LABELS, LoadReading, MachineLoad, Verdict, read_load  # noqa: E402
from minillm.classroom.regions import stub_of  # noqa: E402  (the one stub detector)
from minillm.config import HF_CHECKPOINTS, PRESETS  # noqa: E402
from minillm.bench.roofline import Ceilings, measure_ceilings  # noqa: E402
from plots import plot_checks, plot_roofline, ticks_at  # noqa: E402,F401  (the figures' helpers, lessons/plots.py)
from tables import ms, pct, print_over_100_note, print_table  # noqa: E402,F401  (the tables', lessons/tables.py)
from minillm.bench.timing import environment, si  # noqa: E402
from minillm.bench.threads import ThreadChoice, apply_threads, choose_threads  # noqa: E402
from minillm.checkpoints.load import (add_model_arguments, add_quantization_argument, load_model,  # noqa: E402
                                      locate, random_model)
from minillm.device import resolve_device, resolve_dtype  # noqa: E402
from minillm.cpu_layout import kernels  # noqa: E402
from minillm.device import set_num_threads  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "lessons" / "results"
STUB_EXIT = 3  # exit status of a lesson that stopped at an exercise still to be written


def prediction_arg(text: str) -> tuple[str, float]:
    """`--predict KEY=VALUE`: a student's prediction of one check, as (key, value)."""
    key, sep, value = text.partition("=")
    try:
        if not (sep and key.strip()):
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with VALUE a number (e.g. --predict "
                                         "speedup=3.5); the lesson's prediction lines name its keys") from None


def make_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every lesson takes; `--help` shows the lesson's whole docstring."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, weights_dir=False)
    add_quantization_argument(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes that finish in seconds on a CPU")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores free when the lesson starts; see minillm/bench/threads.py)")
    parser.add_argument("--predict", action="append", type=prediction_arg, default=[], metavar="KEY=VALUE",
                        help="your own prediction of one check, entered before the lesson measures (repeatable; KEY: "
                             "a check's key, as the lesson's prediction lines print it); kept in the results file")
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
    started: LoadReading  # the machine's load at the start
    threads: ThreadChoice | None = None
    predictions: list[str] = field(default_factory=list)  # what the lesson predicted before it measured
    expected: dict[str, float] = field(default_factory=dict)  # check key → the cost model's value, before measuring
    plot_titles: list[str] = field(default_factory=list)  # the saved plot's titles, as drawn

    @property
    def config(self):
        return self.model.config

    @property
    def student(self) -> dict[str, float]:
        """The student's own predictions (`--predict KEY=VALUE`), check key → value."""
        return dict(getattr(self.args, "predict", None) or [])

    def load(self) -> MachineLoad:
        """The machine's load from the start of the lesson until now."""
        return MachineLoad.between(self.started, read_load())


def quiet_load_model(name: str, device, dtype, quantization: str | None = None):
    """load_model, with a one-line note instead of a banner when the weights are not downloaded."""
    folder, preset = locate(name)
    if preset is None or folder.is_dir() or preset not in HF_CHECKPOINTS:
        return load_model(name, device, dtype, quantization=quantization)
    if not os.environ.get("MINILLM_LESSONS_WEIGHTS_NOTE_SHOWN"):  # run_all.py said it once for every lesson
        print(f"(no weights in {folder}: a seeded random init of the {preset} shape; times and bytes do not depend "
              f"on the values. `python weights_download.py {preset}` fetches the real ones)")
    return random_model(PRESETS[preset], device, dtype, quantization=quantization)


def weights_layout(model) -> str:
    """How the loader laid the weights out for this device: the kernel path every step the lesson times takes."""
    return kernels(model)


def start(name: str, args: argparse.Namespace, ceilings: bool = True, on_one_thread: bool = False) -> Lesson:
    """Resolve device and dtype, load the model, read the machine's load, and measure the device's ceilings (on a
    CPU on one thread with `on_one_thread`, for a lesson whose steps run on one)."""
    threads = apply_threads(choose_threads(getattr(args, "threads", None)))  # before our own work loads the CPU
    started = read_load()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = quiet_load_model(args.model, device, dtype, getattr(args, "quantization", None))
    one = on_one_thread and device.type == "cpu"
    with one_thread() if one else contextlib.nullcontext():
        ceil = measure_ceilings(device, dtype, quick=args.quick, quantization=getattr(args, "quantization", None)) \
            if ceilings else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lesson = Lesson(name, args, model, device, dtype, ceil, out, started, threads)
    quantization = getattr(args, "quantization", None)
    print(f"== {name} ==  model {args.model} ({model.weights_source}), {device}, {str(dtype).removeprefix('torch.')}"
          f"{f', {quantization} weights' if quantization else ''}{', quick' if args.quick else ''}")
    print(f"threads: {threads.reason}")
    if ceil is not None:
        line = (f"this machine's limits, measured now with the kernels the model runs{' on one thread' * one} "
                f"(results file: \"ceilings\"): "
                f"compute {si(ceil.matmul_flops, 'FLOP/s')}, memory {si(ceil.bandwidth, 'B/s')}; so a step that does "
                f"fewer than {ceil.ridge:.1f} FLOPs per byte it reads waits on memory, more waits on arithmetic")
        if ceil.datasheet:
            d = ceil.datasheet
            line += f"   [{d['source']}: {si(d['matmul_flops'], 'FLOP/s')}, {si(d['bandwidth'], 'B/s')}]"
        print(line)
    print()
    return lesson


@contextlib.contextmanager
def one_thread():
    """Run a model of tiny matrices on one thread: its kernels gain nothing from more, and on shared cores
    the extra threads only wait for each other (docs/lessons_notes.md)."""
    before = torch.get_num_threads()
    set_num_threads(1)
    try:
        yield
    finally:
        set_num_threads(before)


def check_student_keys(student: dict[str, float], keys) -> None:
    """Every `--predict` key must be one of the lesson's check keys: stop, naming them, where one is not."""
    if unknown := sorted(set(student) - set(keys)):
        raise SystemExit(f"--predict {', '.join(unknown)}: no check of this lesson has that key; its checks' keys are "
                         f"{', '.join(sorted(keys)) or '(none)'}: use one of them, e.g. --predict {min(keys, default='KEY')}"
                         f"=1.5")


def predict(lesson: Lesson, *lines: str, expect: dict[str, float] | None = None) -> None:
    """Print what the lesson expects, before it measures (from the ceilings and the cost model), and keep it:
    `lines` in words, and `expect`, check key → the value the cost model gives that check, one line each with
    the student's own (`--predict`) beside it."""
    for line in lines:
        print(f"prediction: {line}")
        lesson.predictions.append(line)
    if expect is not None:
        check_student_keys(lesson.student, expect)
        lesson.expected.update(expect)
    for key, value in (expect or {}).items():
        yours = f"   (yours: {lesson.student[key]:.3g})" if key in lesson.student else ""
        print(f"prediction: {key} = {value:.3g}{yours}")
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
        if key == "predict":
            parts += [x for k, v in value or [] for x in (flag, f"{k}={v:g}")]
        elif value is True:
            parts.append(flag)
        elif value is not False and value is not None:
            parts += [flag, str(value)]
    return " ".join(parts)


def print_predictions(lesson: Lesson, verdict: Verdict) -> None:
    """Each check's prediction, the student's and the measured median, side by side."""
    rows = [[c.key, "-" if c.predicted is None else c.fmt.format(c.predicted),
             c.fmt.format(lesson.student[c.key]) if c.key in lesson.student else "-", c.fmt.format(c.median),
             "-" if (r := c.over_predicted()) is None else f"{r[0]:.2f}"] for c in verdict.checks]
    print_table(["check", "lesson predicted", "you predicted", "measured (median)", "measured ÷ lesson's"], rows,
                "Predictions against the measurement" + ("" if lesson.student else
                                                         " (enter your own first: --predict KEY=VALUE)") + ":")


def write_results(lesson: Lesson, figures: dict, verdict: Verdict) -> Path:
    """`<out>/<name>.json`: environment, model, ceilings, every figure, the predictions (the lesson's and the
    student's), the verdict and the wall time."""
    check_student_keys(lesson.student, [c.key for c in verdict.checks])
    print_predictions(lesson, verdict)
    doc = {
        "lesson": lesson.name,
        "command": command_line(lesson),
        "quick": lesson.args.quick,
        "model": lesson.args.model,
        "weights_source": lesson.model.weights_source,
        "quantization": getattr(lesson.args, "quantization", None),
        "layout": weights_layout(lesson.model),
        "environment": environment(lesson.device, lesson.dtype),
        "threads": lesson.threads.as_dict() if lesson.threads else None,
        "predictions": lesson.predictions,
        "lesson_predictions": {c.key: c.predicted for c in verdict.checks},
        "student_predictions": lesson.student,
        "ceilings": lesson.ceilings.as_dict() if lesson.ceilings else None,
        "figures": figures,
        "verdict": verdict.as_dict(),
        "plot_titles": lesson.plot_titles,
        "wall_s": time.perf_counter() - lesson.started.wall,
    }
    path = lesson.out / f"{lesson.name}.json"
    path.write_text(json.dumps(_jsonable(doc), indent=2) + "\n")
    print(f"results: {path}")
    return path


def verdict_title(verdict: Verdict) -> str:
    """The figure's title: the verdict and the claim (each judged number is on the plot's own panels)."""
    return f"{LABELS[verdict.outcome]}: {verdict.claim}"


def save_plot(lesson: Lesson, fig, verdict: Verdict | None = None) -> Path:
    """Save the figure with the verdict as its title; every panel title is kept for the results file
    (so that a test can check each number in them against the figures)."""
    if verdict is not None:
        fig.suptitle("\n".join(textwrap.wrap(verdict_title(verdict), 150)), fontsize=11,
                     color={"HOLDS": "darkgreen", "NOT SUPPORTED": "firebrick"}.get(verdict.outcome, "black"))
    lesson.plot_titles = [t for t in ([fig._suptitle.get_text()] if fig._suptitle else [])
                          + [ax.get_title() for ax in fig.axes] if t]
    path = lesson.out / f"{lesson.name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot:    {path}")
    return path


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


__all__ = ["make_parser", "start", "Lesson", "predict", "check_student_keys", "plot_checks", "pct", "print_over_100_note", "si", "ms", "print_table", "write_results", "save_plot", "ticks_at",
           "plot_roofline", "run", "one_thread", "plt", "DEFAULT_OUT", "REPO_ROOT", "STUB_EXIT"]

"""The command line: `python -m minillm <command> ...`.

    python -m minillm generate --model gpt2 --prompt "The meaning of life is" --max-tokens 40

`generate` prints the text, then the two numbers that describe a request's
speed: TTFT (time to first token: the prefill, one forward pass over the whole
prompt) and decode tokens/s (one forward pass per token, reading the KV cache).
Both are timed after one untimed warm-up run of the same prompt, so neither
counts the one-off cost of a first call (allocations, kernel selection).

Bad input (a flag out of range, an unknown device, a broken checkpoint, text
that is not UTF-8) is one `error:` line and exit code 2, never a traceback.
Ctrl-C is one `interrupted` line and exit code 130 (128 + SIGINT, as a shell
reports it).

Each command is one `add_<name>_command(subparsers)` function that adds its
parser and sets `func`; `COMMANDS` lists them. A new command is one such
function and one entry in that list.
"""
from __future__ import annotations

import argparse
import sys
import time

from .kv_cache import generate as cached_generate
from .request_checks import check_prompt
from .sampling_params import SamplingParams
from .checkpoints.tokenizer import load_tokenizer
from .checkpoints.load import add_model_arguments, add_quantization_argument, load_model
from .device import resolve_device, resolve_dtype, synchronize


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags; an error names the flag it came from."""
    fields = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
                  seed=args.seed, ignore_eos=args.ignore_eos)
    for name, value in fields.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            raise ValueError(f"--{name.replace('_', '-')} {value}: {e}") from None
    return SamplingParams(**fields)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = load_model(args.model, device, dtype, args.weights_dir, quantization=args.quantization)
    tokenizer = load_tokenizer(args.model, args.weights_dir)
    prompt_ids = tokenizer.encode(args.prompt)
    check_prompt(model.config, prompt_ids, params.max_tokens)
    # Untimed warm-up: a first call pays one-off costs (allocation, kernel choice) that are not the request's.
    cached_generate(model, [prompt_ids], SamplingParams(temperature=0.0, max_tokens=min(2, params.max_tokens)))

    marks: list[float] = []  # wall time after each forward pass; marks[0] ends the prefill

    def on_step(step: int, num_tokens: int) -> None:
        synchronize(device)
        marks.append(time.perf_counter())

    synchronize(device)
    start = time.perf_counter()
    new_ids = cached_generate(model, [prompt_ids], params, on_step=on_step)[0]

    print(tokenizer.decode(prompt_ids + new_ids))
    print("-" * 60)
    weights = f", {args.quantization} weights" if args.quantization else ""
    print(f"model    {args.model} ({model.weights_source}) on {device}, {str(dtype).removeprefix('torch.')}{weights}")
    print(f"tokens   prompt {len(prompt_ids)}, generated {len(new_ids)}; tokenizer: {tokenizer.name}")
    ttft = marks[0] - start
    line = f"TTFT     {ttft * 1e3:.1f} ms (prefill {len(prompt_ids) / ttft:.0f} tok/s; after an untimed warm-up run)"
    if len(marks) > 1:
        decode_s = marks[-1] - marks[0]
        line += f"   decode {(len(marks) - 1) / decode_s:.1f} tok/s over {len(marks) - 1} steps"
    print(line)
    return 0


def add_generate_command(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt and time it",
                              description="Generate with the KV cache; print the text, TTFT and decode tok/s.")
    add_model_arguments(p)
    add_quantization_argument(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seeds the sampling, so a run is reproducible")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    p.set_defaults(func=run_generate)


def add_bench_command(subparsers) -> None:
    from .bench import offline as bench
    p = subparsers.add_parser("bench", help="prefill and decode speed against this device's measured ceilings",
                              description=bench.__doc__.splitlines()[0])
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)


def add_serve_commands(subparsers) -> None:
    """`serve` and `bench-serve` (server.py, bench_serve.py); they need the [serve] extra only when run."""
    from .serving import cli as serve_cli
    serve_cli.add_commands(subparsers)


COMMANDS = [add_generate_command, add_bench_command, add_serve_commands]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description="minillm: a teaching-grade LLM engine")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input (CheckpointError is a ValueError): the message says it all
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: python -m minillm {args.command} stopped by Ctrl-C", file=sys.stderr)
        return 130


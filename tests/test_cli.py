"""`python -m minillm generate`: the text, TTFT and decode tok/s; bad input as a message, not a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minillm import PRESETS, SamplingParams
from minillm import __main__ as cli
from minillm.naive_decode import generate as naive_generate
from minillm.tokenizer import ByteTokenizer
from minillm.weights import random_model, save_pretrained

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *args):
    code = cli.main(["generate", "--model", "tiny", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_generate_prints_the_naive_decode_text_and_the_timings(capsys, tmp_path):
    code, out, _ = run(capsys, "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0",
                       "--weights-dir", str(tmp_path))
    assert code == 0
    tok = ByteTokenizer(PRESETS["tiny"].eos_token_id, PRESETS["tiny"].vocab_size)
    model = random_model(PRESETS["tiny"], "cpu", "fp32")
    new = naive_generate(model, tok.encode("Hello"), SamplingParams(temperature=0.0, max_tokens=6))
    assert out.splitlines()[0] == tok.decode(tok.encode("Hello") + new)
    assert "TTFT" in out and "decode" in out and "tok/s" in out and "random-init (seed 0)" in out


def test_seeded_sampling_is_reproducible(capsys, tmp_path):
    args = ("--prompt", "abc", "--max-tokens", "8", "--temperature", "1.0", "--top-k", "50",
            "--ignore-eos", "--weights-dir", str(tmp_path))
    first = run(capsys, *args, "--seed", "3")[1].splitlines()[0]
    again = run(capsys, *args, "--seed", "3")[1].splitlines()[0]
    other = run(capsys, *args, "--seed", "4")[1].splitlines()[0]
    assert first == again and first != other


def test_a_checkpoint_folder_works_as_model(capsys, tmp_path):
    save_pretrained(random_model(PRESETS["tiny"], "cpu", "fp32", seed=9), tmp_path / "ckpt")
    code = cli.main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "x", "--max-tokens", "2"])
    assert code == 0 and str(tmp_path / "ckpt") in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (("--prompt", ""), "prompt is empty"),
    (("--prompt", "x" * 200), "n_ctx=128"),
    (("--prompt", "x", "--max-tokens", "0"), "max_tokens=0"),
    (("--prompt", "x", "--dtype", "int3"), "unknown dtype 'int3'"),
    (("--prompt", "x", "--top-p", "0"), "top_p=0.0"),
])
def test_bad_input_is_a_message_and_exit_code_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_unknown_model_lists_the_presets(capsys):
    assert cli.main(["generate", "--model", "gpt5", "--prompt", "x"]) == 2
    assert "gpt2-xl" in capsys.readouterr().err


def test_a_command_is_one_registered_function(monkeypatch):
    def add_echo_command(subparsers):
        p = subparsers.add_parser("echo")
        p.add_argument("word")
        p.set_defaults(func=lambda args: len(args.word))

    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, add_echo_command])
    assert cli.main(["echo", "four"]) == 4


@pytest.mark.slow  # a fresh interpreter imports torch: ~3 s
def test_python_dash_m_runs():
    done = subprocess.run([sys.executable, "-m", "minillm", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "generate" in done.stdout

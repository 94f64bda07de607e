"""`python -m minillm generate`: the text, TTFT and decode tok/s; bad input as a message, not a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm import PRESETS, SamplingParams
from minillm import cli
from minillm.naive_decode import generate as naive_generate
from minillm.checkpoints.tokenizer import ByteTokenizer
from minillm.checkpoints.load import random_model, save_pretrained

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


# ---- user input never ends in a traceback: one `error:` line, exit code 2 ------------------------------


@pytest.mark.parametrize("args, message", [
    (("--prompt", "x", "--device", "meta"), "unknown device 'meta'"),
    (("--prompt", "caf\udce9"), "not valid UTF-8 at character 3"),  # a Latin-1 byte in argv
    (("--prompt", "x", "--seed", str(2**70)), "--seed 1180591620717411303424: seed="),
    (("--prompt", "x", "--seed", "-1"), "--seed -1: seed=-1 must be in"),
    (("--prompt", "x", "--temperature", "nan"), "--temperature nan: temperature=nan must be a finite number"),
    (("--prompt", "x", "--temperature", "1e-45"), "--temperature 1e-45: temperature=1e-45 must be 0 (greedy) or"),
    (("--prompt", "x", "--top-k", "-3"), "--top-k -3: top_k=-3 must be ≥ -1"),
])
def test_bad_flags_are_one_line_naming_the_flag(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("change, field", [
    ({"n_head": 0}, "n_head=0 must be"),
    ({"n_embd": None}, "n_embd=None is a NoneType; it must be an integer"),
    ({"n_layer": "2"}, "n_layer='2' is a str"),
    ({"n_embd": 64.0}, "n_embd=64.0 is a float"),
    ({"n_embd": 1e12}, "n_embd=1000000000000.0 is a float"),
    ({"n_embd": 10**12}, "n_embd=1000000000000 must be in"),
    ({"n_embd": 66}, "n_embd=66 is not divisible by n_head=4"),
    ({"eos_token_id": [1, 2]}, "eos_token_id=[1, 2] is a list"),
    ({"eos_token_id": 600}, "eos_token_id=600 must be in [0, 512)"),
    ({"layer_norm_epsilon": "abc"}, "layer_norm_epsilon='abc' is a str"),
    ({"layer_norm_epsilon": -1}, "layer_norm_epsilon=-1 must be in (0, 1)"),
    ({"n_positions": 0}, "n_positions=0 must be"),
    ({"vocab_size": None}, "vocab_size=None is a NoneType"),
])
def test_a_malformed_config_json_names_the_file_and_the_field(capsys, tmp_path, change, field):
    folder = save_pretrained(random_model(PRESETS["tiny"], "cpu", "fp32"), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    code = cli.main(["generate", "--model", str(folder), "--prompt", "x", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and str(folder / "config.json") in err and field in err and "Traceback" not in err


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", "the top level is a JSON list"),
    (b'{"n_layer": 2}', "missing field(s) n_head, n_embd, vocab_size"),
    ('{"n_layer": 2, "note": "é"}'.encode("latin-1"), "is not UTF-8 text (byte 0xe9"),
    (b"{not json", "is not valid JSON"),
])
def test_a_config_json_that_is_not_a_config_names_the_file(capsys, tmp_path, content, message):
    folder = save_pretrained(random_model(PRESETS["tiny"], "cpu", "fp32"), tmp_path / "ckpt")
    (folder / "config.json").write_bytes(content)
    code = cli.main(["generate", "--model", str(folder), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and str(folder / "config.json") in err and message in err and "Traceback" not in err


def test_nan_weights_are_an_error_naming_the_likely_causes(capsys, tmp_path):
    model = random_model(PRESETS["tiny"], "cpu", "fp32")
    with torch.no_grad():
        model.h[1].attn.c_proj.weight[3, 5] = float("nan")
    folder = save_pretrained(model, tmp_path / "nan")
    code = cli.main(["generate", "--model", str(folder), "--prompt", "x", "--temperature", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "NaN or ±inf" in err and "layer_norm_epsilon" in err and "Traceback" not in err


def test_generate_warms_up_before_it_times(capsys, tmp_path, monkeypatch):
    calls = []
    real = cli.cached_generate
    monkeypatch.setattr(cli, "cached_generate", lambda *a, **k: calls.append(k.get("on_step")) or real(*a, **k))
    code, out, _ = run(capsys, "--prompt", "Hi", "--max-tokens", "3", "--weights-dir", str(tmp_path))
    assert code == 0 and len(calls) == 2 and calls[0] is None and calls[1] is not None, "one untimed run first"
    assert "after an untimed warm-up run" in out


@pytest.mark.parametrize("args, message", [
    (("--threads", "0"), "--threads 0 must be at least 1"),
    (("--context-len", "-5"), "--context-len -5 must be at least 0"),
    (("--batch", "0"), "--batch 0 must be at least 1"),
    (("--warmup", "-1"), "--warmup -1 must be at least 0"),
    (("--sweep", "0,16"), "--sweep '0,16': every batch size must be at least 1"),
    (("--sweep-context", "-1"), "--sweep-context -1 must be at least 0"),
])
def test_bench_rejects_bad_numbers_before_loading_anything(capsys, args, message):
    code = cli.main(["bench", "--model", "tiny", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_bench_help_speaks_plainly():
    parser = cli.build_parser()
    bench_parser = parser._subparsers._group_actions[0].choices["bench"]
    assert "`" not in bench_parser.format_help()

"""The side by side with vLLM: its plan without vLLM, its commands, and its table (vLLM itself is never run here)."""
import sys
from pathlib import Path

import pytest

from minillm.bench import vllm_side


def fake_vllm(tmp_path) -> str:
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return str(exe)


def test_without_vllm_only_minillms_servers_and_client_run_and_it_says_so(monkeypatch):
    monkeypatch.setenv("PATH", "")
    servers, clients, note = vllm_side.plan(vllm_side.parse_args([]))
    assert servers == ["minillm", "minillm-int8", "minillm-w8a8"] and clients == ["bench-serve"]
    assert "vLLM is not installed" in note and "--vllm" in note


def test_with_vllm_every_server_and_client_runs(tmp_path):
    servers, clients, note = vllm_side.plan(vllm_side.parse_args(["--vllm", fake_vllm(tmp_path)]))
    assert servers == list(vllm_side.SERVERS) and clients == list(vllm_side.CLIENTS) and note is None


@pytest.mark.parametrize("argv, says", [(["--vllm", "/no/such/vllm"], "--vllm /no/such/vllm: no such file"),
                                        (["--rates", "0"], "--rates 0"), (["--num-prompts", "0"], "--num-prompts 0")])
def test_bad_arguments_are_refused_naming_the_value(argv, says, capsys):
    with pytest.raises(SystemExit):
        vllm_side.parse_args(argv)
    assert says in capsys.readouterr().err


def test_each_round_starts_one_server_further_on():
    servers = ["a", "b", "c"]
    assert [vllm_side.order(servers, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]


def test_servers_listen_on_localhost_with_their_own_flags(tmp_path):
    args = vllm_side.parse_args(["--vllm", fake_vllm(tmp_path)])
    for server in vllm_side.SERVERS:
        argv, env = vllm_side.server_command(server, Path("/ck"), 1234, args)
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "1234"
        assert argv[argv.index("--served-model-name") + 1] == vllm_side.SERVED_NAME
        assert ("--quantization" in argv) == (server in ("minillm-int8", "minillm-w8a8"))
        assert server not in ("minillm-int8", "minillm-w8a8") or argv[argv.index("--quantization") + 1] == server[8:]
        assert (argv[argv.index("--dtype") + 1] == "float32") if server == "vllm-fp32" else "--dtype" not in argv
        assert ("VLLM_CPU_KVCACHE_SPACE" in env) == server.startswith("vllm")
    client = vllm_side.client_command("vllm-bench", 1234, float("inf"), tmp_path / "r.json", Path("/ck"), 50257, args)
    assert client[:5] == [*vllm_side.vllm_cli(args.vllm), "bench", "serve"]
    assert client[client.index("--request-rate") + 1] == "inf"
    assert client[client.index("--result-filename") + 1] == "r.json" and "--ignore-eos" in client


def test_vllm_runs_under_its_own_venvs_interpreter_with_the_version_shim(tmp_path):
    exe = tmp_path / "vllm"
    exe.write_text("#!/opt/v/bin/python3\nimport sys\n")
    assert vllm_side.vllm_cli(str(exe)) == ["/opt/v/bin/python3", "-c", vllm_side.SHIM]
    assert vllm_side.vllm_cli(fake_vllm(tmp_path))[0] == str(tmp_path / "python")  # no python on its #! line
    compile(vllm_side.SHIM, "shim", "exec")


def run(server, client, rate, rnd, itl, tok_s=50.0, completed=8):
    return {"server": server, "client": client, "rate": rate, "round": rnd, "num_prompts": 8, "load": (2.0, 3.5),
            "summary": {"output_throughput": tok_s, "median_ttft_ms": 250.0, "median_itl_ms": itl,
                        "completed": completed}}


def test_the_table_has_a_row_per_client_and_rate_and_the_itl_ratio_per_round():
    inf = float("inf")
    runs = [run("minillm", "bench-serve", 1.0, 1, 40.0), run("vllm", "bench-serve", 1.0, 1, 50.0),
            run("minillm", "bench-serve", 1.0, 2, 60.0), run("vllm", "bench-serve", 1.0, 2, 50.0),
            run("minillm", "vllm-bench", inf, 1, 100.0, completed=7), {**run("vllm", "vllm-bench", inf, 1, 0),
                                                                        "error": "exit 1: boom"}]
    text = vllm_side.table(runs, ["minillm", "vllm"]).splitlines()
    assert text[0] == "| client, rate | minillm | vllm |" and len(text) == 4
    assert text[2].startswith("| bench-serve, 1/s | 50.0 tok/s, TTFT 0.25 s, ITL 40 ms (load 2.0→3.5); 50.0 tok/s")
    assert text[3].startswith("| vllm-bench, all at once | ") and "7/8 done" in text[3]
    assert "failed (exit 1: boom)" in text[3]
    ratios = vllm_side.itl_ratios(runs)
    assert ratios == ["minillm ITL p50 ÷ vllm's, bench-serve, 1/s: 0.80, 1.20 (per round; target ≤ 1)"]


def test_each_servers_log_gives_its_weights_and_threads():
    minillm = ("serving ckpt (random-init (seed 0), float32, int8 weights) on cpu at http://127.0.0.1:1/v1 "
               "(max_num_seqs=32, torch threads: 1 thread: 2 CPUs in this process's affinity, packed); Ctrl-C stops")
    vllm = ("INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/ck', dtype=torch.bfloat16, "
            "max_seq_len=1024\nINFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n")
    assert vllm_side.how_it_runs(minillm) == "float32, int8 weights, 1 thread"
    assert vllm_side.how_it_runs(vllm) == "bfloat16, core ids=[0]"
    assert vllm_side.how_it_runs("") == "its log names neither dtype nor threads"


def test_a_server_that_cannot_start_is_an_error_naming_it(tmp_path):
    with pytest.raises(RuntimeError, match="/no/such/python"):
        vllm_side.start(["/no/such/python", "-c", "pass"], {}, vllm_side.free_port(), tmp_path / "log")
    with pytest.raises(RuntimeError, match="(?s)exited with code 0; its log.*bad flag"):
        vllm_side.start([sys.executable, "-c", "print('bad flag')"], {}, vllm_side.free_port(), tmp_path / "log")

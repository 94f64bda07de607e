"""The peers script's own logic, with no peer installed or built: its ratios, its table, the line it prints
for a peer that cannot run, and how it reads llama.cpp's and the stand-in tokenizer's output."""
import argparse
import json
import stat

import pytest

from minillm.bench import peer_engines, peers


def rounds(*pairs):
    """Per-round figures: (batch-1 ms, prefill tok/s) each; batch 16 at ten times batch 1."""
    return [{"decode_ms": {1: ms, 16: 10 * ms}, "prefill_tok_s": tok_s} for ms, tok_s in pairs]


def test_a_ratio_is_taken_round_by_round_not_from_the_medians():
    results = {"minillm fp32": rounds((10, 2000), (30, 1000), (20, 1500)),
               "llama.cpp f32": rounds((10, 1000), (10, 1000), (40, 1000))}
    med, lo, hi = peers.ratio(results, ("minillm fp32", 1), ("llama.cpp f32", 1))
    assert (med, lo, hi) == (1.0, 0.5, 3.0)  # per round 1, 3, 0.5; the medians' ratio would be 2.0
    assert peers.ratio(results, ("minillm fp32", "prefill"), ("llama.cpp f32", "prefill"))[0] == 1.5
    assert peers.ratio(results, ("minillm fp32", 4), ("llama.cpp f32", 4)) is None  # batch 4 not timed


def test_each_target_is_judged_and_a_peer_that_did_not_run_is_named():
    results = {"minillm fp32": rounds((11, 2000)), "minillm int8": rounds((4, 1900)),
               "llama.cpp f32": rounds((10, 1000)), "llama.cpp Q8_0": rounds((4, 1100))}
    lines = peers.ratio_lines(results)
    assert lines[0] == "fp32 batch 1 ÷ llama.cpp f32: 1.10× (rounds 1.10–1.10; target ≤ 1.05×: NOT met)"
    assert lines[1].startswith("int8 batch 1 ÷ llama.cpp Q8_0: 1.00×") and lines[1].endswith(": met)")
    assert lines[3] == "int8 batch 16 ÷ CTranslate2 int8: not measured (CTranslate2 int8 did not run)"
    assert lines[4].startswith("fp32 prefill ÷ llama.cpp f32 (tok/s): 2.00×") and lines[4].endswith(": met)")
    for rows in results.values():
        del rows[0]["decode_ms"][16]
    assert peers.ratio_lines(results)[2] == "int8 batch 16 ÷ llama.cpp Q8_0: not measured (batch 16 not in --batches)"


def test_the_table_holds_medians_and_the_floor_beside_each_minillm_dtype_only():
    results = {"minillm int8": rounds((4, 1800), (6, 2000), (5, 1900)), "CTranslate2 int8": rounds((7, None))}
    lines = peers.table(results, {"minillm int8": 0.0025}, (1, 16), 128)
    assert lines[0] == ("| engine (ms per decode step) | batch 1 | batch 16 | prefill 128 tokens | weight-read floor "
                        "| batch 1 ÷ floor |")
    assert lines[2] == "| minillm int8 | 5.00 | 50.00 | 1,900 tok/s | 2.50 | 2.00× |"
    assert lines[3] == "| CTranslate2 int8 | 7.00 | 70.00 | — | — | — |"


def arguments(tmp_path, **over):
    p = argparse.ArgumentParser()
    peers.add_arguments(p)
    args = p.parse_args(["--cache-dir", str(tmp_path), "--llama-cpp", str(tmp_path / "missing")])
    args.batches = (1,)
    return argparse.Namespace(**{**vars(args), **over})


def test_without_llama_cpp_or_ctranslate2_each_gets_one_line_and_minillm_runs_alone(tmp_path, monkeypatch):
    def no_ct2(checkpoint, out):
        raise peer_engines.PeerMissing("CTranslate2: `import ctranslate2` failed (pip install -e .[peers])")
    monkeypatch.setattr(peers, "ct2_models", no_ct2)
    said = []
    timers = peers.peers(arguments(tmp_path, no_build=True), tmp_path / "checkpoint", said.append)
    assert timers == {}
    assert said == [f"peer missing: llama.cpp: no llama-bench, llama-batched-bench, llama-quantize in "
                    f"{tmp_path / 'missing'}, and building was turned off (--no-build)",
                    "peer missing: CTranslate2: `import ctranslate2` failed (pip install -e .[peers])"]


def test_the_time_budget_counts_a_build_and_conversions_only_where_they_are_missing(tmp_path):
    first = peers.budget(arguments(tmp_path))  # 20 min build + 3 min conversions + 3 rounds of 160 s
    assert first.startswith("time budget: about 31 min") and "to build llama.cpp once" in first
    assert "to convert the checkpoint once" in first
    bin_dir = tmp_path / "missing" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-batched-bench").touch()
    (tmp_path / "peers" / "gpt2-converted").mkdir(parents=True)
    (tmp_path / "peers" / "gpt2-converted" / "model-Q8_0.gguf").touch()
    again = peers.budget(arguments(tmp_path, rounds=5))
    assert again.startswith("time budget: about 13 min") and "build" not in again and "convert" not in again


def test_llama_cpp_that_cannot_be_built_says_what_was_tried_and_what_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_engines.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    with pytest.raises(peer_engines.PeerMissing) as e:
        peer_engines.llama_cpp(tmp_path / "missing", build=True)
    assert str(e.value) == (f"llama.cpp: no llama-bench, llama-batched-bench, llama-quantize in {tmp_path / 'missing'}"
                            ", and it cannot be built here: no cmake on PATH (apt-get install cmake g++)")
    assert not (tmp_path / "missing").exists()  # nothing downloaded, nothing half-made


@pytest.mark.parametrize("source", ["src", "."])
def test_a_built_llama_cpp_is_found_in_this_scripts_layout_or_a_checkouts(tmp_path, source):
    home = tmp_path / "llama.cpp"
    (home / "build" / "bin").mkdir(parents=True)
    for tool in peer_engines.LLAMA_TOOLS:
        (home / "build" / "bin" / tool).touch()
    with pytest.raises(peer_engines.PeerMissing, match="no convert_hf_to_gguf.py in"):
        peer_engines.llama_cpp(home, build=False)
    (home / source).mkdir(exist_ok=True)
    (home / source / "convert_hf_to_gguf.py").touch()
    assert peer_engines.llama_cpp(home, build=False) == home
    assert peer_engines.llama_source(home) == home / source  # home / "." is home


def test_llama_batched_bench_output_becomes_ms_per_step_and_prefill_tok_s(tmp_path):
    home = tmp_path / "llama.cpp"
    (home / "build" / "bin").mkdir(parents=True)
    lines = [json.dumps({"pp": 128, "tg": 16, "pl": pl, "t_pp": 0.1 * pl, "speed_pp": 1280.0,
                         "t_tg": t_tg, "speed_tg": 16 * pl / t_tg}) for pl, t_tg in ((1, 0.16), (16, 0.64))]
    tool = home / "build" / "bin" / "llama-batched-bench"
    tool.write_text("#!/bin/sh\necho 'llama_model_loader: noise'\n" + "".join(f"echo '{line}'\n" for line in lines))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    got = peer_engines.llama_steps(home, tmp_path / "m.gguf", threads=2, prompt_len=128, batches=(1, 16), steps=16)
    assert got["decode_ms"] == pytest.approx({1: 10.0, 16: 40.0}) and got["prefill_tok_s"] == 1280.0
    tool.write_text("#!/bin/sh\necho 'error: unable to load model' >&2\nexit 1\n")
    with pytest.raises(peer_engines.PeerMissing, match=r"llama-batched-bench on m.gguf failed \(exit 1\): error: unable"):
        peer_engines.llama_steps(home, tmp_path / "m.gguf", 2, 128, (1,))


def test_the_stand_in_tokenizer_has_the_checkpoints_vocabulary_size_and_round_trips_bytes(tmp_path):
    from tokenizers import Tokenizer
    peer_engines.stand_in_tokenizer(tmp_path, 50257)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 50257 and tok.token_to_id(peer_engines.END_OF_TEXT) == 50256
    text = "héllo, wörld 🦙"
    assert tok.decode(tok.encode(text).ids) == text and len(tok.encode("hello").ids) == 3  # byte pairs merged
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == peer_engines.END_OF_TEXT


def test_ctranslate2_steps_take_the_best_of_repeats_so_a_slowed_short_run_does_not_make_a_step_negative(tmp_path,
                                                                                                       monkeypatch):
    clock = {"now": 0.0, "calls": 0}

    class Generator:  # a stand-in: 10 ms a prompt, 1 ms a new token; the first timed prefill slowed 100 ms by load
        def __init__(self, *args, **kwargs):
            pass

        def generate_batch(self, prompts, max_length, **kwargs):
            clock["calls"] += 1
            clock["now"] += 0.010 + 0.001 * max_length + (0.100 if clock["calls"] == 2 else 0.0)

    monkeypatch.setitem(__import__("sys").modules, "ctranslate2", type("ct2", (), {"Generator": Generator}))
    monkeypatch.setattr(peer_engines.time, "perf_counter", lambda: clock["now"])
    (tmp_path / "vocabulary.json").write_text(json.dumps(["a", "b", peer_engines.END_OF_TEXT]))
    r = peer_engines.ct2_steps(tmp_path, "int8", 1, 4, [1], steps=16)
    assert r["decode_ms"][1] == pytest.approx(1.0)  # a single timing each: (0.027 - 0.111) / 16 < 0
    assert r["prefill_tok_s"] == pytest.approx(4 / 0.011)

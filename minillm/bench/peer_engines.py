"""The outside parties of `peers.py`, fed the very checkpoint minillm reads: llama.cpp and CTranslate2.

One random-init checkpoint in Hugging Face's layout (`save_pretrained`, with a stand-in byte-level BPE
tokenizer of GPT-2's size: no real vocabulary ships with this repo, and no step timed here reads text)
goes to each engine through that engine's own converter:

- llama.cpp: `convert_hf_to_gguf.py --outtype f32` from llama.cpp's source, then `llama-quantize … Q8_0`;
  timed by `llama-batched-bench` (a prefill of `npp` tokens per sequence, then `ntg` decode steps of
  `npl` sequences at once). Where no build is found in `<home>/build/bin`, it is built once there from
  the llama.cpp that the `llama-cpp-python` sdist vendors (fetched with pip), Release, `-DGGML_NATIVE=ON`,
  only `LLAMA_TOOLS` (`llama-bench` too, for a reader's own `-d` depth checks).
- CTranslate2: `ct2-transformers-converter --quantization float32|int8` (as `python -m
  ctranslate2.converters.transformers`, the interpreter's own install), timed through
  `Generator.generate_batch`: a decode step is the time of `n` more greedy tokens over `n`.

Every failure is a `PeerMissing` whose one line says what was tried and what failed; nothing here is
imported by minillm itself, and neither peer is a dependency (`pip install -e .[peers]`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_SDIST = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp: the tools, convert_hf_to_gguf.py, gguf-py
LLAMA_TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
LLAMA_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]
END_OF_TEXT = "<|endoftext|>"


class PeerMissing(RuntimeError):
    """A peer that cannot run here; the message is one line: what was tried, what failed, the fix."""


def run_tool(cmd: list, what: str, log: Path | None = None, env: dict | None = None) -> str:
    """Run `cmd`; what it wrote (stdout, then stderr), or PeerMissing naming `what` and the last line it wrote."""
    try:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    except OSError as e:
        raise PeerMissing(f"{what}: `{cmd[0]}` could not start ({e})") from None
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerMissing(f"{what} failed (exit {done.returncode}): {tail[0][:200]}"
                          + (f"; full log {log}" if log else ""))
    return done.stdout + done.stderr


# ---- the checkpoint every engine reads ------------------------------------------------------------

def stand_in_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens (256 bytes, then byte pairs, then END_OF_TEXT) with GPT-2's
    pre-tokenizer: what both converters need to write a vocabulary; the ids, not the text, are timed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = {c: i for i, c in enumerate(alphabet)}, []
    pairs = ((a, b) for a in alphabet for b in alphabet)
    while len(vocab) < vocab_size - 1:
        a, b = next(pairs)
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    vocab[END_OF_TEXT] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END_OF_TEXT])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2TokenizerFast", "bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT,
         "unk_token": END_OF_TEXT, "model_max_length": 1024}, indent=2) + "\n")


def write_checkpoint(folder: Path, preset: str, seed: int = 0) -> Path:
    """`preset`'s shape, random init (`seed`), saved once in Hugging Face's GPT-2 layout with the tokenizer."""
    from ..checkpoints.load import random_model, save_pretrained
    from ..config import PRESETS

    if (folder / "tokenizer_config.json").is_file():
        return folder
    save_pretrained(random_model(PRESETS[preset], "cpu", "fp32", seed), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"],
                                                    "model_type": "gpt2"}, indent=2) + "\n")
    stand_in_tokenizer(folder, config["vocab_size"])
    return folder


# ---- llama.cpp ----------------------------------------------------------------------------------

def llama_source(home: Path) -> Path:
    """Where `home` keeps llama.cpp's source: `src/` as this script builds it, else `home` itself (a checkout)."""
    return home / "src" if (home / "src" / "convert_hf_to_gguf.py").is_file() else home


def llama_cpp(home: Path, build: bool = True, log=print) -> Path:
    """`home`, holding llama.cpp's source (`src/`, or `home` itself: a checkout) and its tools in `build/bin/`:
    found, or built there."""
    bin_dir, src = home / "build" / "bin", llama_source(home)
    missing = [t for t in LLAMA_TOOLS if not (bin_dir / t).is_file()]
    if not missing and (src / "convert_hf_to_gguf.py").is_file():
        return home
    found = f"no {', '.join(missing) or 'convert_hf_to_gguf.py'} in {home}"
    if not build:
        raise PeerMissing(f"llama.cpp: {found}, and building was turned off (--no-build)")
    tools = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if tools:
        raise PeerMissing(f"llama.cpp: {found}, and it cannot be built here: no {' or '.join(tools)} on PATH "
                          "(apt-get install cmake g++)")
    home.mkdir(parents=True, exist_ok=True)
    src = home / "src" if src == home and not (home / "CMakeLists.txt").is_file() else src
    if not (src / "CMakeLists.txt").is_file():
        run_tool([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_SDIST,
                  "-d", home], f"llama.cpp: {found}; downloading its source (pip download {LLAMA_SDIST})")
        sdist = next(home.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            inner = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
            tar.extractall(home / "unpacked", members=inner, filter="data")
        (next((home / "unpacked").glob("*/vendor/llama.cpp"))).rename(src)
        shutil.rmtree(home / "unpacked")
    log(f"building llama.cpp ({', '.join(LLAMA_TOOLS)}) in {home / 'build'}: slow on few cores, done once")
    started = time.perf_counter()
    run_tool(["cmake", "-S", src, "-B", home / "build", *LLAMA_CMAKE], "llama.cpp: cmake configure",
             home / "configure.log")
    run_tool(["cmake", "--build", home / "build", "-j", str(os.cpu_count() or 1), "--target", *LLAMA_TOOLS],
             "llama.cpp: cmake --build", home / "build.log")
    log(f"built llama.cpp in {(time.perf_counter() - started) / 60:.1f} min")
    return home


# The converter matches the tokenizer's pre-tokenization against known models' hashes; the stand-in
# tokenizer matches none, so its pre-tokenizer is named as GPT-2's, whose rule (ByteLevel) it uses.
CONVERT = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); import conversion.base as b; "
           "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; sys.argv = sys.argv[1:]; "
           "sys.argv[0] = sys.argv[0] + '/convert_hf_to_gguf.py'; runpy.run_path(sys.argv[0], run_name='__main__')")


def to_gguf(home: Path, checkpoint: Path, out: Path) -> dict[str, Path]:
    """{"f32": …, "Q8_0": …}: `checkpoint` through llama.cpp's converter, then `llama-quantize`; kept in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    f32, q8 = out / "model-f32.gguf", out / "model-Q8_0.gguf"
    if not f32.is_file():
        run_tool([sys.executable, "-c", CONVERT, llama_source(home), checkpoint, "--outtype", "f32",
                  "--outfile", f32],
                 "llama.cpp: convert_hf_to_gguf.py --outtype f32", out / "convert.log")
    if not q8.is_file():
        run_tool([home / "build" / "bin" / "llama-quantize", f32, q8, "Q8_0"], "llama.cpp: llama-quantize Q8_0",
                 out / "quantize.log")
    return {"f32": f32, "Q8_0": q8}


def llama_steps(home: Path, gguf: Path, threads: int, prompt_len: int, batches, steps: int = 16) -> dict:
    """{"decode_ms": {batch: ms per decode step}, "prefill_tok_s": …} from one `llama-batched-bench` run:
    each batch's sequences prefill `prompt_len` tokens apiece, then decode `steps` tokens together."""
    ctx = max(batches) * (prompt_len + steps + 16)  # 16 spare slots a sequence: llama.cpp pads its cache
    out = run_tool([home / "build" / "bin" / "llama-batched-bench", "-m", gguf, "-t", threads, "-tb", threads,
                    "-c", ctx, "-b", 2048, "-ub", 512, "-npp", prompt_len, "-ntg", steps,
                    "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"],
                   f"llama.cpp: llama-batched-bench on {gguf.name}")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_batch = {r["pl"]: r for r in rows}
    return {"decode_ms": {b: by_batch[b]["t_tg"] * 1e3 / steps for b in batches},
            "prefill_tok_s": by_batch[min(batches)]["speed_pp"]}


# ---- CTranslate2 --------------------------------------------------------------------------------

def ct2_models(checkpoint: Path, out: Path) -> dict[str, Path]:
    """{"float32": …, "int8": …}: `checkpoint` through `ct2-transformers-converter`, kept in `out`."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise PeerMissing("CTranslate2: `import ctranslate2` failed (pip install -e .[peers])") from None
    made = {}
    for kind in ("float32", "int8"):
        made[kind] = out / f"ct2-{kind}"
        if not (made[kind] / "model.bin").is_file():
            run_tool([sys.executable, "-m", "ctranslate2.converters.transformers", "--model", checkpoint,
                      "--output_dir", made[kind], "--quantization", kind, "--force"],
                     f"CTranslate2: ct2-transformers-converter --quantization {kind}")
    return made


def ct2_steps(path: Path, compute_type: str, threads: int, prompt_len: int, batches, steps: int = 16,
              seed: int = 0, repeats: int = 3) -> dict:
    """{"decode_ms": {batch: ms per step}, "prefill_tok_s": …}: a step is (the time of a prompt and `steps` + 1
    new tokens − that of the prompt and 1) ÷ `steps`, and a prefill the prompt and 1 token (its first token
    comes from the prompt's forward pass), one sequence; greedy, every sequence held to its length (min_length),
    on `threads` threads. Each of the two times is the best of `repeats`: a difference of single timings goes
    negative when load slows the shorter one."""
    import ctranslate2
    import numpy as np

    gen = ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type, inter_threads=1,
                                intra_threads=threads)
    vocab = [t for t in json.loads((path / "vocabulary.json").read_text()) if t != END_OF_TEXT]
    rng = np.random.default_rng(seed)

    def timed(batch: int, new: int) -> float:
        prompts = [[vocab[i] for i in rng.integers(0, len(vocab), prompt_len)] for _ in range(batch)]
        t0 = time.perf_counter()
        gen.generate_batch(prompts, max_length=new, min_length=new, sampling_topk=1,
                           include_prompt_in_result=False)
        return time.perf_counter() - t0

    decode, first = {}, {}
    for b in batches:
        timed(b, 1)  # warm-up
        first[b] = min(timed(b, 1) for _ in range(repeats))  # the prompt's forward pass and its one token: a prefill
        decode[b] = (min(timed(b, steps + 1) for _ in range(repeats)) - first[b]) * 1e3 / steps
    return {"decode_ms": decode, "prefill_tok_s": prompt_len / first[min(batches)]}

"""The GPU path's targets, measured for gpu_check.py: batch-1 decode against the hardware and a fair reference.

For one model (bf16 on CUDA), the seconds per decoded token of minillm's
engine with CUDA graphs and with enforce_eager, against

- the weight-read floor: weight bytes ÷ the measured bandwidth (`roofline.py`);
- transformers' `GPT2LMHeadModel.generate` on the same weights and prompt:
  eager (its dynamic cache), and with its static cache and
  `disable_compile=True` (on CUDA, transformers 5 otherwise compiles
  `generate` by itself when the cache is static: that would time a compiled,
  graph-captured generate under the name "static cache, eager");
- in a stage of its own (`compiled_reference`), the same static-cache generate
  compiled by torch.compile, compiled outside the timed part: both generation
  lengths are run once first, since a static cache of another length is
  another shape and compiles again.

Seconds per token = (time(LONG) − time(SHORT)) / (LONG − SHORT), medians of a
few repeats, so the prefill and the setup cancel out. Every figure is
recorded with the number of graphs torch.compile made while it was timed
(`dynamo_graphs`: 0 means nothing was compiled there).

TARGETS are provisional until measured on a GPU. Reading the code gives the
estimate that the first measurement is to be compared with: a replay still
runs about 20 kernels per layer and every step waits on one `.tolist()`, so
gpt2 at about 10–14× its floor and gpt2-xl at about 3–4×.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..checkpoints.load import load_model
from ..cuda_graphs import DecodeRunner
from ..device import synchronize
from ..engine import LLMEngine
from ..kv_pool import CacheConfig
from ..kv_cache import KVCache, Segment
from ..sampling_params import SamplingParams
from ..scheduler import SchedulerConfig
from .cost import weight_read_floor
from .roofline import measure_ceilings
from .steps import count_ops

TARGETS = {  # (model, figure): (bound, "max": the figure must stay at or below it, "min": at or above)
    ("gpt2-xl", "graph_times_floor"): (1.5, "max"),
    ("gpt2", "graph_times_floor"): (3.0, "max"),
    ("gpt2-xl", "speedup_vs_reference_eager"): (3.0, "min"),
    ("gpt2-xl", "speedup_vs_reference_static"): (1.0, "min"),
}
ESTIMATES = {"gpt2 graph_times_floor": "10–14", "gpt2-xl graph_times_floor": "3–4"}  # from reading the code
PROMPT_LEN, SHORT, LONG = 32, 16, 144


def dynamo_graphs() -> int:
    """How many graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def decode_time_per_token(generate, sync, short: int = SHORT, long: int = LONG, repeats: int = 3) -> dict:
    """Seconds per decoded token, every length generated once first (warm-up and any compile stay outside)."""
    def timed(n):
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            generate(n)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    generate(short)
    generate(long)
    graphs = dynamo_graphs()
    per_token = (timed(long) - timed(short)) / (long - short)
    return {"s_per_token": per_token, "dynamo_graphs": dynamo_graphs() - graphs}


def check_targets(name: str, device: str = "cuda", dtype=None, short: int = SHORT, long: int = LONG) -> dict:
    """Batch-1 decode of `name`: the engine with graphs and eager against the floor and the references, and the
    ops one step dispatches. Off CUDA the "graph" engine decodes eagerly and the op count uses the static step."""
    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    model = load_model(name, device, dtype)  # a random init where no weights are: time does not depend on values
    cfg = model.config
    long = min(long, cfg.n_ctx - PROMPT_LEN)  # a small shape's context (tiny: 128) bounds the long run
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    sync = lambda: synchronize(device)  # noqa: E731
    bandwidth = measure_ceilings(device, dtype, quick=device.type != "cuda").bandwidth
    floor = weight_read_floor(cfg, dtype, bandwidth)
    result = {"ok": True, "dtype": str(dtype), "prompt_len": PROMPT_LEN, "tokens": [short, long],
              "bandwidth": bandwidth, "weight_read_floor_s": floor}
    tokens = {}
    for label, eager in (("graph", False), ("eager", True)):
        with LLMEngine(model, SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8),
                       cache_config=CacheConfig(kv_cache_memory_bytes=1 << 30), enforce_eager=eager) as engine:
            def generate(n, label=label, engine=engine):
                out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
                tokens[label] = out.output_token_ids
                return out
            result[label] = {"decode_mode": engine.decoder.mode, **decode_time_per_token(generate, sync, short, long),
                             "median_itl_s": statistics.median(generate(long).metrics.itls)}
        result[label]["times_floor"] = result[label]["s_per_token"] / floor
    result["graph_tokens_equal_eager"] = tokens["graph"] == tokens["eager"]
    result["ok"] = result["graph_tokens_equal_eager"]
    result["graph_times_floor"] = result["graph"]["times_floor"]
    cache = KVCache(cfg, 1, PROMPT_LEN + 1, device, dtype)  # ops of one step: eager, and around a replay
    step = [Segment(0, PROMPT_LEN, 1, True)]
    runner = DecodeRunner(model, cache, 1, "graph" if device.type == "cuda" else "static")
    with torch.inference_mode():
        ids = torch.tensor([[prompt[0]]], device=device)
        runner.run(step, [prompt[0]])  # a lazily captured graph is captured here, outside the count
        result["ops_per_step"] = {
            "eager": count_ops(lambda: model(ids, cache.prepare(step).positions, cache=cache)).as_dict(),
            runner.mode: count_ops(lambda: runner.run(step, [prompt[0]])).as_dict()}
    del runner, cache
    ours = result["graph"]["s_per_token"]
    try:
        hf, ids = reference_model(model, prompt)
        result["max_abs_logit_diff_vs_minillm"] = logit_diff(hf, model, ids)
        for label, extra in (("reference_eager", {}),
                             ("reference_static", {"cache_implementation": "static", "disable_compile": True})):
            result[label] = decode_time_per_token(hf_generate(hf, ids, extra), sync, short, long)
            result[f"speedup_vs_{label}"] = result[label]["s_per_token"] / ours
    except ImportError as e:
        result["reference"] = {"error": f"transformers is not installed: {e}"}
    return result


def reference_model(model, prompt):
    """transformers' GPT2LMHeadModel holding our model's weights, and the prompt as its input."""
    import transformers

    from minillm.checkpoints.load import config_to_hf
    with torch.device(model.device):  # its own random init is overwritten below: make it where it runs
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config_to_hf(model.config)))
    hf = hf.to(model.dtype).eval()
    missing, unexpected = hf.transformer.load_state_dict(model.state_dict(), strict=False)
    if [k for k in missing if not k.endswith(("attn.bias", "masked_bias"))] or unexpected:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return hf, torch.tensor([prompt], device=model.device)


def logit_diff(hf, model, ids) -> float:
    with torch.inference_mode():
        return (hf(ids).logits.float() - model(ids).float()).abs().max().item()


def hf_generate(hf, ids, extra: dict):
    def generate(n):
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=hf.config.eos_token_id or 0, **extra)
    return generate


def compiled_reference(model, short: int = SHORT, long: int = LONG) -> dict:
    """transformers' static-cache generate compiled by torch.compile (its own CompileConfig), timed after both
    lengths have compiled. Off CUDA, transformers compiles only when told to compile on every device."""
    import transformers
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_LEN,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    hf, ids = reference_model(model, prompt)
    config = transformers.CompileConfig()
    if model.device.type != "cuda":
        config._compile_all_devices = True  # transformers' own switch for compiling off CUDA (used by its tests)
    graphs = dynamo_graphs()
    t0 = time.perf_counter()
    generate = hf_generate(hf, ids, {"cache_implementation": "static", "compile_config": config})
    timed = decode_time_per_token(generate, lambda: synchronize(model.device), short, long)
    compiled = dynamo_graphs() - graphs - timed["dynamo_graphs"]
    return {"ok": compiled > 0 and timed["dynamo_graphs"] == 0, "transformers": transformers.__version__,
            "mode": config.mode, "graphs_compiled_before_timing": compiled, "wall_s": time.perf_counter() - t0,
            "reference_compiled": timed, "max_abs_logit_diff_vs_minillm": logit_diff(hf, model, ids)}


def judge(targets: dict, compiled: dict | None = None) -> dict:
    """Each target with its measured value, whether it was met (None: not measured) and the estimate to compare.
    The compiled reference is reported beside them, judged by no target."""
    judged = {}
    for (model, figure), (bound, kind) in TARGETS.items():
        value = targets.get(model, {}).get(figure)
        met = None if value is None else (value <= bound if kind == "max" else value >= bound)
        judged[f"{model} {figure}"] = {"value": value, "bound": bound, "kind": kind, "met": met, "provisional": True,
                                       "estimate": ESTIMATES.get(f"{model} {figure}")}
    ours = targets.get("gpt2-xl", {}).get("graph", {}).get("s_per_token")
    theirs = (compiled or {}).get("reference_compiled", {}).get("s_per_token")
    if ours and theirs:
        judged["gpt2-xl speedup_vs_reference_compiled"] = {"value": theirs / ours, "bound": None, "kind": "reported",
                                                           "met": None, "provisional": True, "estimate": None}
    return judged

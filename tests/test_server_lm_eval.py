"""lm-evaluation-harness's `local-completions` model against `minillm serve`.

lm-eval scores a loglikelihood task by sending each (context, continuation) as
token ids with `echo: true, logprobs: 1, max_tokens: 1, temperature: 0`, in
batches of prompts, and summing `choices[i].logprobs.token_logprobs[ctxlen:-1]`
(the continuation's tokens: the last entry is the one generated token);
`is_greedy` asks whether each of those equals the largest of its
`top_logprobs`. generate_until sends `prompt`, `max_tokens`, `temperature: 0`,
`stop`, `seed` and reads `choices[i].text` by `index`.

lm-eval is not a dependency (its install pulls about 50 packages: datasets,
pandas, pyarrow, scipy, scikit-learn, nltk; 100 s here), so the first tests
send exactly its requests and read the answers as it does (lm_eval 0.4.13,
lm_eval/models/openai_completions.py and api_models.py, and its remote
tokenizer's /tokenizer_info, /tokenize and /detokenize); the last, marked slow,
runs lm-eval itself, with a tokenizer file and with `tokenizer_backend=remote`
(no file: the server's tokenizer), and fails, naming `pip install
"lm-eval[api]"`, where it is not installed. Both check the log-likelihood against the sum of
log_softmax of the model's full forward pass.
"""
from __future__ import annotations

from operator import itemgetter

import httpx
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer

from serving_support import NAME, assert_no_block_leaked, model, start  # noqa: F401

from minillm import SamplingParams
from minillm.checkpoints.tokenizer import BPETokenizer
from minillm.kv_cache import generate

CORPUS = ["The KV cache stores the keys and the values of every token.",
          "Prefill is compute-bound; decode is memory-bound.", "the quick brown fox jumps over the lazy dog"] * 3
PAIRS = [("The KV cache stores", " the keys"), ("Prefill is", " compute-bound"), ("the quick brown", " fox jumps"),
         ("decode is", " memory-bound.")]
ATOL = 1e-3  # a sum of up to a few fp32 log-probabilities


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    """A byte-level BPE of 300 ids (the tiny model has 512), trained here: the hub is unreachable."""
    folder = tmp_path_factory.mktemp("bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """As lm-eval splits a pair: encode the whole, and the context; the continuation is the rest."""
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def reference_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = ctx + cont
    with torch.no_grad():
        lp = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    rows = lp[len(ctx) - 1:len(ids) - 1]
    return sum(rows[i, t].item() for i, t in enumerate(cont)), all(int(rows[i].argmax()) == t
                                                                    for i, t in enumerate(cont))


def test_its_loglikelihood_requests_score_as_the_model_does(model, bpe_file):
    tok = BPETokenizer(bpe_file)
    pairs = [encode_pair(tok, c, x) for c, x in PAIRS]
    with start(model, tok, enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True,
               block_size=4) as server:
        for batch in (pairs[:2], pairs[2:]):  # lm-eval's batch_size=2
            payload = {"model": NAME, "prompt": [c + x for c, x in batch], "temperature": 0, "max_tokens": 1,
                       "logprobs": 1, "seed": 1234, "echo": True}
            out = httpx.post(server.url + "/v1/completions", json=payload, timeout=60).json()
            for choice, (ctx, cont) in zip(sorted(out["choices"], key=itemgetter("index")), batch):
                scored = choice["logprobs"]["token_logprobs"][len(ctx):-1]
                tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
                greedy = all(lp == max(top.values()) for lp, top in zip(scored, tops))
                want, want_greedy = reference_loglikelihood(model, ctx, cont)
                assert len(scored) == len(cont) and abs(sum(scored) - want) < ATOL
                assert greedy == want_greedy
        assert_no_block_leaked(server)


def test_its_generate_until_requests_get_the_greedy_text(model, bpe_file):
    tok = BPETokenizer(bpe_file)
    contexts = [tok.encode(c) for c, _ in PAIRS[:2]]
    wants = [tok.decode(ids) for ids in generate(model, contexts, SamplingParams(temperature=0, max_tokens=8))]
    with start(model, tok) as server:
        payload = {"prompt": contexts, "model": NAME, "max_tokens": 8, "temperature": 0,
                   "stop": ["<|endoftext|>"], "seed": 1234}
        out = httpx.post(server.url + "/v1/completions", json=payload, timeout=60).json()
    texts = [None] * len(out["choices"])
    for choice in out["choices"]:
        texts[choice["index"]] = choice["text"]
    assert texts == [w.split("<|endoftext|>")[0] for w in wants]


def test_its_remote_tokenizer_reads_tokenizer_info_and_tokenizes_through_the_server(model, bpe_file):
    """`tokenizer_backend=remote` (lm_eval.utils.RemoteTokenizer): GET /tokenizer_info for the special tokens,
    then POST /tokenize (with `add_special_tokens: false`) and /detokenize, as vLLM answers them."""
    tok = BPETokenizer(bpe_file)
    with start(model, tok) as server:
        info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
        assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 128
        assert info["tokenizer_class"] and info["chat_template"] is None
        eos = httpx.post(server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                         timeout=30).json()["tokens"]
        assert eos == [tok.eos_token_id]
        text = PAIRS[0][0]
        ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                         timeout=30).json()["tokens"]
        assert ids == tok.encode(text)
        assert httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"] == text


@pytest.mark.slow  # lm-eval is not a dependency: run with -m slow after `pip install "lm-eval[api]"`
@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_itself_scores_and_generates_through_the_server(model, bpe_file, tmp_path, backend):
    for module in ("lm_eval", "tenacity"):  # tenacity: what its API models need (the [api] extra)
        try:
            __import__(module)
        except ImportError as e:
            pytest.fail(f"this test runs lm-eval itself, and {module!r} is not importable ({e}): "
                        "pip install \"lm-eval[api]\" and run it again (the two tests above send lm-eval's "
                        "requests without it, in the normal suite)", pytrace=False)
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_file=str(bpe_file), eos_token="<|endoftext|>").save_pretrained(tmp_path)
    tok = BPETokenizer(bpe_file)
    with start(model, tok) as server:
        files = {"tokenizer": str(tmp_path)} if backend == "huggingface" else {}  # remote: none, the server's
        lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=NAME, tokenizer_backend=backend,
                                 tokenized_requests=True, batch_size=2, max_length=128, max_retries=1, **files)
        scored = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)],
                                  disable_tqdm=True)
        contexts = [c for c, _ in PAIRS[:2]]
        generated = lm.generate_until([Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 8}), i)
                                       for i, c in enumerate(contexts)], disable_tqdm=True)
    for (ll, greedy), (c, x) in zip(scored, PAIRS):
        want, want_greedy = reference_loglikelihood(model, *encode_pair(tok, c, x))
        assert abs(ll - want) < ATOL and greedy == want_greedy
    wants = [tok.decode(ids) for ids in generate(model, [tok.encode(c) for c in contexts],
                                                 SamplingParams(temperature=0, max_tokens=8))]
    assert generated == [w.split("<|endoftext|>")[0].split("\n\n")[0] for w in wants]

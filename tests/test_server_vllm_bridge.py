"""The bridge to vLLM, both ways, without vLLM installed.

    vllm bench serve ──▶ minillm serve      `vllm_bench_request` below speaks as vLLM's
                                            benchmark client does (vllm/benchmarks/lib/
                                            endpoint_request_func.py): the payload it sends
                                            and the way it reads the stream
    minillm bench-serve ──▶ vllm serve      `vllm_like_app` answers as vLLM's OpenAI server
                                            does (its ModelCard, its stream chunks)

What each side needs of the other (docs/serving.md's table says the same):
  * vLLM's client reads /v1/models' data[0].id and data[0].root (when --model is
    left out); splits the stream on blank lines, drops the "data: " prefix (with its
    space), skips ":" comments, stops at [DONE]; times an event with a non-empty
    `choices` as a token, reading choices[0].text (chat: choices[0].delta.content);
    takes usage.completion_tokens and usage.prompt_tokens from the last event. It
    sends repetition_penalty 1.0 and logprobs null, ignore_eos with --ignore-eos,
    max_completion_tokens and text parts for chat, and OPENAI_API_KEY as a bearer.
  * minillm's bench-serve reads /v1/models' data[0].id (when --model is left out)
    and max_model_len (else --max-model-len); an event with a non-empty `choices` is
    a token; usage.completion_tokens when sent. It sends the prompt as token ids,
    max_tokens, temperature 0, ignore_eos true, stream, stream_options.include_usage.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from models import random_prompts
from serving_support import NAME, model, start, tokenizer  # noqa: F401
from test_server_chat import CHATML

from minillm.bench.serve import benchmark, summarize
from minillm.bench import workloads
from minillm.serving.chat_template import ChatTemplate


def vllm_bench_request(url: str, payload: dict, chat: bool = False, api_key: str | None = None) -> dict:
    """One request as `vllm bench serve --backend openai(-chat)` sends and reads it; what it records."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    record = {"success": False, "text": "", "ttft": None, "itl": [], "output_tokens": None, "prompt_len": None}
    began = last = time.perf_counter()
    buffer = ""
    with httpx.stream("POST", url, json=payload, headers=headers, timeout=60) as r:
        if r.status_code != 200:
            return {**record, "error": r.status_code}
        for piece in r.iter_text():
            buffer += piece
            while "\n\n" in buffer:
                message, buffer = buffer.split("\n\n", 1)
                message = message.strip()
                if not message or message.startswith(":"):
                    continue
                data = message.removeprefix("data: ")
                if data == "[DONE]":
                    continue
                event, now = json.loads(data), time.perf_counter()
                if event.get("choices"):  # a token: the first one's time is the TTFT, the others' gaps the ITLs
                    choice = event["choices"][0]
                    record["text"] += (choice["delta"].get("content") if chat else choice.get("text")) or ""
                    if record["ttft"] is None:
                        record["ttft"] = now - began
                    else:
                        record["itl"].append(now - last)
                    last = now
                elif event.get("usage"):
                    record["output_tokens"] = event["usage"]["completion_tokens"]
                    record["prompt_len"] = event["usage"].get("prompt_tokens")
    record["success"] = record["ttft"] is not None
    return record


def test_vllm_bench_serve_reads_minillm_as_it_reads_vllm(model, tokenizer):
    prompts = [tokenizer.decode(p) for p in random_prompts(3, [8, 12], seed=4)]
    with start(model, tokenizer, chat_template=ChatTemplate(CHATML), server=dict(api_key="k")) as server:
        models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"}).json()
        model_id, root = models["data"][0]["id"], models["data"][0]["root"]  # a KeyError here crashed vLLM 0.x
        assert (model_id, root) == (NAME, NAME)
        for prompt in prompts:
            completion = {"model": model_id, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": 16,
                          "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                          "ignore_eos": True, "temperature": 0.0}
            got = vllm_bench_request(server.url + "/v1/completions", completion, api_key="k")
            want = httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer k"},
                              json={"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0}).json()
            assert got["success"] and got["text"] == want["choices"][0]["text"]
            assert (got["output_tokens"], got["prompt_len"]) == (16, want["usage"]["prompt_tokens"])
            assert len(got["itl"]) == 15
            chat = {"model": model_id, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
                    "max_completion_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "temperature": 0.0}
            got = vllm_bench_request(server.url + "/v1/chat/completions", chat, chat=True, api_key="k")
            assert got["success"] and got["output_tokens"] == 16
        assert vllm_bench_request(server.url + "/v1/completions", completion)["error"] == 401


VLLM_COMPLETION_FIELDS = {  # those of vLLM's CompletionRequest that a benchmark client might send
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
    "stream_options", "ignore_eos", "logprobs", "repetition_penalty", "min_tokens", "n", "echo", "best_of"}


def vllm_like_app(max_model_len: int, seen: list) -> FastAPI:
    """A stand-in for `vllm serve`: its /v1/models card, and its /v1/completions stream (a chunk per token with
    "usage": null, the last with finish_reason "length", then a usage chunk with no choices, then [DONE])."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "openai-community/gpt2", "object": "model", "created": 0,
                                            "owned_by": "vllm", "root": "openai-community/gpt2", "parent": None,
                                            "max_model_len": max_model_len, "permission": []}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        n, prompt_len = body["max_tokens"], len(body["prompt"])

        async def events():
            for k in range(n):
                await asyncio.sleep(0.001)
                choice = {"index": 0, "text": f" t{k}", "logprobs": None,
                          "finish_reason": "length" if k == n - 1 else None, "stop_reason": None}
                yield "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0,
                                             "model": body["model"], "choices": [choice], "usage": None}) + "\n\n"
            usage = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + n, "completion_tokens": n}
            yield "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0,
                                         "model": body["model"], "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_minillm_bench_serve_reads_a_vllm_server():
    import uvicorn
    seen: list[dict] = []
    server = uvicorn.Server(uvicorn.Config(vllm_like_app(1024, seen), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        requests = [workloads.Request(p, o, 0.0) for p, o in zip(random_prompts(4, [5, 9], vocab_size=50257), [3, 5, 8, 2])]
        results, duration = asyncio.run(benchmark(f"http://{host}:{port}", requests, show_progress=False))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert all(r.success for r in results) and [r.output_tokens for r in results] == [3, 5, 8, 2]
    assert [len(r.token_times) for r in results] == [3, 5, 8, 2]  # the usage chunk, with no choices, is no token
    assert summarize(results, duration)["completed"] == 4
    for body in seen:
        assert set(body) <= VLLM_COMPLETION_FIELDS, set(body) - VLLM_COMPLETION_FIELDS
        assert body["model"] == "openai-community/gpt2" and all(isinstance(t, int) for t in body["prompt"])
        assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}


def test_minillm_answers_with_every_field_vllm_sends(model, tokenizer):
    """The fields of vLLM's stream chunks that a client may read are in minillm's too."""
    with start(model, tokenizer) as server:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
                "prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    token, usage = events[0], events[-1]
    assert {"id", "object", "created", "model", "choices"} <= set(token) and token["object"] == "text_completion"
    assert {"index", "text", "logprobs", "finish_reason"} <= set(token["choices"][0])
    assert usage["choices"] == [] and set(usage["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}

"""/metrics under vLLM's names: what a dashboard, `vllm bench serve` or llm-d's router reads, with vLLM's types and
its `model_name` and `engine` labels, beside the `minillm:` names; parsed as Prometheus parses it."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serving_support import NAME, assert_no_block_leaked, model, start, tokenizer  # noqa: F401

VLLM = {  # vLLM's name (as its Prometheus family is named) → its type
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram"}


def scrape(server) -> dict:
    """{family name: (type, {(sample name, labels as a sorted tuple): value})}."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str, **labels) -> float:
    key = (sample, tuple(sorted({"model_name": NAME, "engine": "0", **labels}.items())))
    return families[family][1][key]


def test_vllm_names_types_and_labels_count_what_was_served(model, tokenizer):
    prompt = list(range(10, 42))  # 32 tokens: 8 blocks of 4, of which the second request finds 7 cached
    with start(model, tokenizer, enable_prefix_caching=True, block_size=4) as server:
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200
        assert_no_block_leaked(server)
        families = scrape(server)
    for name, kind in VLLM.items():
        assert families[name][0] == kind, (name, families.get(name, ("absent",))[0])
        for sample_name, labels in families[name][1]:
            assert dict(labels)["model_name"] == NAME and dict(labels)["engine"] == "0", (name, labels)
    assert value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 64
    assert value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 10
    assert value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 64
    assert value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 28
    assert value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    for phase in ("queue", "prefill", "decode"):
        family = f"vllm:request_{phase}_time_seconds"
        assert value(families, family, family + "_count") == 2
    assert value(families, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 8
    assert value(families, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert families["minillm:prompt_tokens"][1][("minillm:prompt_tokens_total", ())] == 64  # the old names stay


def test_a_preemption_is_counted(model, tokenizer):
    """Two requests that each need most of a pool of 10 blocks of 16: the newer is preempted, and counted."""
    with start(model, tokenizer, num_blocks=10, max_num_seqs=2) as server:
        import threading
        body = {"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True}
        threads = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                    kwargs={"json": body, "timeout": 120}) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert_no_block_leaked(server)
        families = scrape(server)
    assert value(families, "vllm:num_preemptions", "vllm:num_preemptions_total") >= 1

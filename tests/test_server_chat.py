"""/v1/chat/completions with a chat template, /v1/models' root, and /tokenize and /detokenize as vLLM has them.

GPT-2 has no chat template, so without --chat-template the chat endpoint answers
400 saying so. With one, a chat is the template's rendering of the messages sent
as a completion: the greedy reply must equal the greedy completion of that text,
streamed or not, through the official `openai` client.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from serving_support import NAME, assert_no_block_leaked, model, start, tokenizer  # noqa: F401
from test_server_errors import assert_openai_shape

from minillm.serving.chat_template import ChatTemplate

CHATML = ("{% for m in messages %}"
          "{% if m.role not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('no role ' ~ m.role ~ ' in this template') }}{% endif %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def chat_server(model, tokenizer):
    with start(model, tokenizer, chat_template=ChatTemplate(CHATML)) as server:
        yield server


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_without_a_chat_template_the_chat_endpoint_says_how_to_get_one(model, tokenizer):
    with start(model, tokenizer) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            client_for(server).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4)
        message = assert_openai_shape(caught.value.response.json(), 400, "BadRequestError", "messages")
        assert "has no chat template" in message and "--chat-template FILE" in message


def test_a_chat_is_the_greedy_completion_of_its_rendered_messages(chat_server):
    client = client_for(chat_server)
    rendered = ChatTemplate(CHATML).render(MESSAGES)
    assert rendered.endswith("<|im_start|>assistant\n") and "Be brief." in rendered
    want = client.completions.create(model=NAME, prompt=rendered, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.choices[0].text
    assert whole.choices[0].finish_reason == want.choices[0].finish_reason
    assert whole.usage.prompt_tokens == want.usage.prompt_tokens
    assert whole.usage.completion_tokens == want.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens and not chunks[-1].choices
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert_no_block_leaked(chat_server)


@pytest.mark.parametrize("messages, param, phrase", [
    ([{"role": "tool", "content": "42"}], "messages", "refused the messages: no role tool in this template"),
    ([{"role": "user", "content": 42}], "messages[0].content", "is 42"),
    ([{"content": "hi"}], "messages[0].role", "messages[0].role is required"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type", "is \"image_url\"; it must be 'text'"),
])
def test_chat_errors_name_the_message_and_field(chat_server, messages, param, phrase):
    r = httpx.post(chat_server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400
    assert phrase in assert_openai_shape(r.json(), 400, "BadRequestError", param)


def test_text_parts_are_joined_by_a_newline_as_vllm_joins_them(chat_server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "a KV cache?"}]}]
    tokens = httpx.post(chat_server.url + "/tokenize", json={"messages": parts}).json()["tokens"]
    joined = [{"role": "user", "content": "What is\na KV cache?"}]
    assert tokens == httpx.post(chat_server.url + "/tokenize", json={"messages": joined}).json()["tokens"]


def test_models_names_its_root_as_vllm_does(chat_server):
    (card,) = client_for(chat_server).models.list().data
    assert (card.id, card.root, card.max_model_len) == (NAME, NAME, 128)


def test_tokenize_and_detokenize_as_vllm_has_them(chat_server, tokenizer):
    r = httpx.post(chat_server.url + "/tokenize", json={"model": NAME, "prompt": "The KV cache"}).json()
    assert r["tokens"] == tokenizer.encode("The KV cache") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128
    back = httpx.post(chat_server.url + "/detokenize", json={"model": NAME, "tokens": r["tokens"]}).json()
    assert back == {"prompt": "The KV cache"}
    chat = httpx.post(chat_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode(ChatTemplate(CHATML).render(MESSAGES))
    for path, body, param, phrase in [
            ("/detokenize", {"tokens": [1, 100000]}, "tokens[1]", "token id 100000 at position 1 is outside"),
            ("/detokenize", {"tokens": [1, True]}, "tokens[1]", "is true"),
            ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt", "either a prompt"),
            ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", "does not exist")]:
        r = httpx.post(chat_server.url + path, json=body)
        status = 404 if param == "model" else 400
        assert phrase in assert_openai_shape(r.json(), status, "NotFoundError" if status == 404
                                             else "BadRequestError", param)


def test_a_template_that_is_not_jinja_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("line one\n{% for m in messages %}{{ m.content }}\n")
    with pytest.raises(ValueError, match=r"broken.jinja is not a valid Jinja template \(line 2\)"):
        ChatTemplate.from_file(path)
    with pytest.raises(ValueError, match="cannot read it"):
        ChatTemplate.from_file(tmp_path / "absent.jinja")

"""The live page in a real browser: headless Chromium opens /live while a scripted workload runs, and the page
must show what the engine did.

    chunked prefill   three 8-token requests prefill in one step ("prefill 24") and decode; a 100-token prompt
                      arrives; with a budget of 67 tokens a step holds 3 decodes and the first 64 prompt
                      tokens: the page lists "prefill 64 + decode 3", then "prefill 36 + decode 3"
    prefix sharing    two prompts share their first 48 tokens (3 blocks of 16); the second one's step says
                      "prefix hit … 48 tok", and held on that step the block map marks exactly those 3
                      blocks as shared by the two requests

The engine thread is held while a request is sent (`EngineHeld`), so the steps are these on a machine however
busy. Driven by Python's playwright and the distribution's `chromium` (apt-get install chromium): nothing is
downloaded. Without either the test fails and says what to install; it never skips. It saves a screenshot
(in the test's tmp dir, and a copy at /tmp/live.png).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time

import httpx
import pytest

from models import context_model

from minillm.checkpoints.tokenizer import load_tokenizer
from minillm.engine import LLMEngine
from minillm.kv_pool import CacheConfig
from minillm.scheduler import SchedulerConfig
from minillm.serving.api_server import make_serving
from minillm.serving.launch import BackgroundServer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUDGET = 67  # 3 decodes + a 64-token chunk
TIMEOUT_MS = 30_000


def open_browser(playwright):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no browser at {CHROMIUM}: install Debian's package, `apt-get install -y chromium` "
                    "(.ci/run does); playwright drives it, and never downloads one of its own")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail('playwright is not installed: python -m pip install -e ".[dev]" (the Python package only; '
                    "never `playwright install`: the test uses the distribution's chromium)")
    return sync_playwright()


def wait_for_step(page, text: str):
    """The step line of the page's log that contains `text`, once it appears; or a failure showing the log."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        return page.wait_for_selector(f"li.step:has-text('{text}')", timeout=TIMEOUT_MS)
    except PlaywrightTimeout:
        shown = page.eval_on_selector_all("li.step", "ls => ls.map(l => l.textContent)")
        prefills = [line for line in shown if "prefill" in line]
        pytest.fail(f"the page shows no step with {text!r}; its newest steps:\n" + "\n".join(shown[:10]) +
                    "\nand those with a prefill:\n" + "\n".join(prefills))


class EngineHeld:
    """The engine thread held between two steps while requests are sent, so that they reach it together however
    slowly a busy machine delivers them (the engine takes every queued command before its next step).
    `one_step()` lets it take what was sent and run exactly one step, then holds it again."""

    def __init__(self, server):
        self.loop, self.holding, self.gate = server.serving.loop, threading.Event(), threading.Event()
        self.again = False

    def _hold(self, engine) -> None:
        self.holding.set()
        assert self.gate.wait(60), "the test never released the engine"
        if self.again:
            # Queued behind what was sent while held: a command that queues the next hold. The engine takes
            # both before its step; the hold they queue waits in the inbox until after it.
            self.again = False
            self.gate.clear()
            self.queues_next = self.loop.call(lambda engine: self.loop.call(self._hold))

    def __enter__(self) -> "EngineHeld":
        self.held = self.loop.call(self._hold)
        assert self.holding.wait(30), "the engine thread did not take the hold"  # the inbox is empty from now
        return self

    def queued(self, n: int) -> None:
        """Wait until n requests wait in the engine thread's inbox: the order they were sent in is theirs."""
        deadline = time.monotonic() + 30
        while self.loop._inbox.qsize() < n:
            assert time.monotonic() < deadline, f"{n} requests were sent but {self.loop._inbox.qsize()} arrived"
            time.sleep(0.01)

    def one_step(self) -> None:
        """Let the engine admit what was sent and run one step; return once it is held again after it."""
        self.holding.clear()
        self.again = True
        self.gate.set()
        self.held.result(timeout=60)  # this hold has returned, and queued the command that queues the next
        self.held = self.queues_next.result(timeout=60)
        assert self.holding.wait(30), "the engine thread did not take the hold after its step"

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self.held.result(timeout=60)


class Stream:
    """One streamed completion on a thread of its own: its id and first token are known as soon as they come."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int):
        self.id, self.first_token, self.done = None, threading.Event(), threading.Event()
        self.error = None
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        threading.Thread(target=self._run, args=(url, body), daemon=True).start()

    def _run(self, url, body):
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.id = json.loads(line[6:])["id"]
                        self.first_token.set()
        except Exception as e:  # noqa: BLE001  (reported by the test's thread)
            self.error = e
        finally:
            self.first_token.set()
            self.done.set()

    def started(self) -> "Stream":
        assert self.first_token.wait(30) and self.error is None, f"the request failed: {self.error}"
        return self


def test_the_page_shows_chunked_prefill_beside_decodes_and_the_blocks_two_requests_share(tmp_path):
    engine = LLMEngine(context_model(),
                       SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=64, enable_prefix_caching=True))
    rng = random.Random(0)
    with BackgroundServer(make_serving(engine, load_tokenizer("tiny"), "tiny")) as server, \
            sync_playwright() as playwright:
        browser = open_browser(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + "/live")
        page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=TIMEOUT_MS)

        with EngineHeld(server) as held:
            decoders = [Stream(server.url, [rng.randrange(256) for _ in range(8)], 119) for _ in range(3)]
            held.queued(3)
            held.one_step()  # the three prefill together; held after that step, they wait, still decoding
            for d in decoders:
                d.started()
            long = Stream(server.url, [rng.randrange(256) for _ in range(100)], 4)
            held.queued(1)
        wait_for_step(page, "prefill 24 = 24/67")
        wait_for_step(page, "prefill 64 + decode 3 = 67/67")
        wait_for_step(page, "prefill 36 + decode 3")
        assert long.done.wait(30) and long.error is None

        shared = [rng.randrange(256) for _ in range(48)]
        with EngineHeld(server) as held:  # admitted in one step: the second shares the blocks the first fills
            first = Stream(server.url, shared + [rng.randrange(256) for _ in range(8)], 60)
            held.queued(1)
            second = Stream(server.url, shared + [rng.randrange(256) for _ in range(8)], 4)
            held.queued(2)
        first.started(), second.started()
        hit = wait_for_step(page, f"prefix hit {second.id[5:9]} 48 tok")
        # Hold that step: the block map shows it, whatever runs after. (A click on the element itself: new steps
        # keep pushing the log's lines down, and a click at the line's place a moment ago may hit its neighbour.)
        hit.dispatch_event("click")
        page.wait_for_selector(f"#now:has-text('step {hit.get_attribute('data-step')}:')", timeout=TIMEOUT_MS)
        assert "held" in page.text_content("#now")
        cells = page.eval_on_selector_all("#blocks .cell.shared", "cs => cs.map(c => c.dataset.owners)")
        held = page.evaluate("JSON.stringify({status: document.getElementById('status').textContent, "
                             "info: document.getElementById('blockinfo').textContent, "
                             "step: steps.find((s) => s.step === pinned)})")
        assert len(cells) == 3, f"the 48 shared prompt tokens fill 3 blocks of 16; the page marks {cells}: {held}"
        assert all(set(owners.split()) == {first.id, second.id} for owners in cells), cells
        running = page.eval_on_selector_all("#running .chip", "cs => cs.map(c => c.dataset.id)")
        assert {first.id, second.id} <= set(running), running

        shot = tmp_path / "live.png"
        page.screenshot(path=str(shot), full_page=True)
        shutil.copy(shot, "/tmp/live.png")
        browser.close()
        for d in decoders + [first, second]:
            assert d.done.wait(30) and d.error is None


def test_behind_an_api_key_the_page_reads_the_feed_with_the_key_from_its_address():
    """The feed is guarded like the other /v1 routes, by the server's own --api-key; the page is static, holds no
    data and stays open, and reads the feed with the key given after `#key=` (an EventSource cannot send a
    header, so the page then reads the stream with fetch)."""
    engine = LLMEngine(context_model(),
                       SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True),
                       cache_config=CacheConfig(num_gpu_blocks_override=32))
    with BackgroundServer(make_serving(engine, load_tokenizer("tiny"), "tiny"), api_key="sk-live") as server:
        url = server.url
        assert httpx.get(url + "/v1/engine/events", timeout=10).status_code == 401
        assert httpx.get(url + "/live", timeout=10).status_code == 200
        with sync_playwright() as playwright:
            browser = open_browser(playwright)
            page = browser.new_page()
            page.goto(url + "/live")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('reconnecting')",
                                   timeout=TIMEOUT_MS)  # no key: the feed refuses the page
            page.goto(url + "/live#key=sk-live")
            page.reload()  # a new fragment alone does not reload the page
            page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=TIMEOUT_MS)
            server.serving.loop.call(lambda e: e.add_request(list(range(1, 20)), None)).result(timeout=30)
            wait_for_step(page, "prefill 19")
            browser.close()

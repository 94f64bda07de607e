"""weights_download.py against a local stand-in for the hub; never the real network.

The fake hub behaves like huggingface.co where it matters: a large (LFS) file's
`resolve` URL answers 302 to a CDN path with `X-Linked-Size` and
`X-Linked-Etag` (the quoted SHA-256); small files answer 200 with a git-style
ETag. The CDN honours `Range`, and can be told to drop the connection mid-file
or to advertise a wrong checksum.
"""
from __future__ import annotations

import hashlib
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import weights_download as wd  # noqa: E402

from minillm.config import HF_CHECKPOINTS  # noqa: E402

BIG = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: several reads, unaligned end
SMALL = b'{"n_layer": 2}\n'


class FakeHub:
    def __init__(self):
        self.files = {"model.safetensors": BIG, "config.json": SMALL, "tokenizer.json": b'{"model": {}}'}
        self.lfs = {"model.safetensors"}
        self.drop_after: int | None = None  # serve this many bytes of the next CDN GET, then hang up
        self.wrong_sha = False
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)

    def handler(hub):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _resolve(self):
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                if "/resolve/main/" in self.path:
                    name = self.path.rsplit("/", 1)[1]
                    if name not in hub.files:
                        self.send_error(404)
                        return None
                    if name in hub.lfs:
                        data = hub.files[name]
                        sha = hashlib.sha256(b"not it" if hub.wrong_sha else data).hexdigest()
                        self.send_response(302)
                        self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/cdn/{name}")
                        self.send_header("X-Linked-Size", str(len(data)))
                        self.send_header("X-Linked-Etag", f'"{sha}"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return None
                    return hub.files[name], hashlib.sha1(hub.files[name]).hexdigest()
                if self.path.startswith("/cdn/"):
                    return hub.files[self.path[5:]], None
                self.send_error(404)
                return None

            def _send(self, head_only: bool):
                found = self._resolve()
                if found is None:
                    return
                data, etag = found
                start = 0
                rng = self.headers.get("Range")
                if rng and self.path.startswith("/cdn/"):
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(data):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                if etag:
                    self.send_header("ETag", f'"{etag}"')
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if head_only:
                    return
                body = data[start:]
                if hub.drop_after is not None and self.path.startswith("/cdn/"):
                    body, hub.drop_after = body[:hub.drop_after], None
                    self.close_connection = True
                self.wfile.write(body)

            def do_HEAD(self):
                self._send(head_only=True)

            def do_GET(self):
                self._send(head_only=False)

        return Handler


@pytest.fixture
def hub(monkeypatch):
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    fake.base = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("HF_ENDPOINT", fake.base)
    yield fake
    server.shutdown()
    server.server_close()


def big_url():
    return wd.file_url("gpt2", "model.safetensors")


def test_checkpoint_names_match_the_presets():
    assert wd.CHECKPOINTS == HF_CHECKPOINTS


def test_hf_endpoint_overrides_the_base_url(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example/")
    assert wd.file_url("gpt2-xl", "config.json") == "http://mirror.example/openai-community/gpt2-xl/resolve/main/config.json"
    monkeypatch.delenv("HF_ENDPOINT")
    assert wd.file_url("gpt2", "model.safetensors").startswith("https://huggingface.co/openai-community/gpt2/")


def test_remote_info_reads_the_lfs_headers_without_following_the_redirect(hub):
    info = wd.remote_info(big_url())
    assert info.size == len(BIG) and info.sha256 == hashlib.sha256(BIG).hexdigest()
    assert [r[0] for r in hub.requests] == ["HEAD"] and "/cdn/" not in hub.requests[0][1]
    small = wd.remote_info(wd.file_url("gpt2", "config.json"))
    assert small.size == len(SMALL) and small.sha256 is None  # a git sha1 is not a sha256


def test_full_download_of_a_checkpoint(hub, tmp_path):
    assert wd.main(["gpt2", "--dir", str(tmp_path), "--no-progress"]) == 0
    folder = tmp_path / "gpt2"
    assert (folder / "model.safetensors").read_bytes() == BIG
    assert (folder / "config.json").read_bytes() == SMALL
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_resume_after_the_connection_drops(hub, tmp_path):
    dest = tmp_path / "gpt2" / "model.safetensors"
    hub.drop_after = 3000
    with pytest.raises(wd.DownloadError, match="run the same command again to resume"):
        wd.download_file(big_url(), dest, retries=0, progress=False)
    part = dest.with_name("model.safetensors.part")
    assert not dest.exists() and part.stat().st_size == 3000
    hub.requests.clear()
    assert wd.download_file(big_url(), dest, progress=False) == "downloaded"
    assert dest.read_bytes() == BIG and not part.exists()
    assert ("GET", "/cdn/model.safetensors", "bytes=3000-") in hub.requests  # only the rest was asked for


def test_a_dropped_connection_is_resumed_within_one_run(hub, tmp_path):
    dest = tmp_path / "model.safetensors"
    hub.drop_after = 5000
    assert wd.download_file(big_url(), dest, retries=2, progress=False) == "downloaded"
    assert dest.read_bytes() == BIG
    assert [r[2] for r in hub.requests if r[1].startswith("/cdn/")] == [None, "bytes=5000-"]


def test_checksum_mismatch_is_rejected_and_leaves_no_file(hub, tmp_path):
    dest = tmp_path / "model.safetensors"
    hub.wrong_sha = True
    with pytest.raises(wd.DownloadError, match="checksum mismatch"):
        wd.download_file(big_url(), dest, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor a .part


def test_skip_when_complete(hub, tmp_path):
    dest = tmp_path / "model.safetensors"
    assert wd.download_file(big_url(), dest, progress=False) == "downloaded"
    hub.requests.clear()
    assert wd.download_file(big_url(), dest, progress=False) == "skipped"
    assert [r[0] for r in hub.requests] == ["HEAD"]


def test_a_complete_part_from_an_earlier_run_is_verified_and_renamed(hub, tmp_path):
    dest = tmp_path / "model.safetensors"
    dest.with_name("model.safetensors.part").write_bytes(BIG)
    assert wd.download_file(big_url(), dest, progress=False) == "downloaded"
    assert dest.read_bytes() == BIG and not any(r[0] == "GET" for r in hub.requests)


def test_missing_file_is_a_clean_error(hub, tmp_path):
    with pytest.raises(wd.DownloadError, match="HTTP 404"):
        wd.download_file(wd.file_url("gpt2", "nope.bin"), tmp_path / "nope.bin", progress=False)


def test_no_network_is_a_clear_message_not_a_traceback(monkeypatch, tmp_path, capsys):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert wd.main(["gpt2", "--dir", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err
    assert not (tmp_path / "gpt2" / "config.json").exists()


def test_unknown_name_lists_the_checkpoints(capsys):
    with pytest.raises(SystemExit) as e:
        wd.main(["gpt3"])
    assert e.value.code == 2 and "gpt2-medium" in capsys.readouterr().err

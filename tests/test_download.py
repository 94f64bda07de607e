"""weights_download.py against a local stand-in for the hub; never the real network.

The fake hub answers as huggingface.co does where it matters. HEAD or GET on
a file's `resolve` URL carries `X-Repo-Commit` and an `ETag`; a small (git)
file answers 200 with its git blob hash as the ETag and its bytes; a large
(LFS) file answers 302 to a CDN on another origin, with `X-Linked-Size` and
`X-Linked-Etag` (the quoted SHA-256). The CDN honours `Range` with 206 and
`Content-Range`. Each fault of the issue is one switch on the fake: no size,
a close-delimited cut, a dropped connection, a size lie, a wrong
`Content-Range`, a slow drip, a wrong checksum, a 404; a full disk is a
file object that runs out of space.
"""
from __future__ import annotations

import errno
import hashlib
import io
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# The downloader speaks huggingface_hub 2 and its httpx2; on a machine without them (the GPU machine has
# huggingface_hub 1.x and no httpx2) this file fails to collect, naming the missing module; gpu_check collects
# only the files that hold gpu tests.
import httpx2  # noqa: E402,F401  (huggingface_hub 2 streams through it)
from huggingface_hub import constants as hub_constants  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import weights_download as wd  # noqa: E402

from minillm.config import HF_CHECKPOINTS, PRESETS  # noqa: E402

BIG = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes, unaligned end
SMALL = b'{"n_layer": 2}\n'
COMMIT = "a" * 40


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Two servers, the hub and its CDN, with switches for every fault."""

    def __init__(self):
        self.files = {"model.safetensors": BIG, "config.json": SMALL, "tokenizer.json": b'{"model": {}}'}
        self.lfs = {"model.safetensors"}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.no_size = False          # HEAD says nothing of the size
        self.no_length = False        # GET bodies are close-delimited: no Content-Length
        self.cut_at: list[int] = []   # the next GETs stop after this many bytes each (one entry per GET)
        self.drop_at: int | None = None  # the next GET announces everything, sends this many bytes, hangs up
        self.extra = 0                # GET streams this many bytes more than the file has
        self.wrong_range = False      # a range request gets bytes from 0, labelled honestly
        self.drip_s: float | None = None  # GET sends one byte every drip_s seconds
        self.wrong_sha = False
        self.faulty = "model.safetensors"  # the cuts, drops, lies, wrong ranges and drips hit this file only
        self.drop_every: int | None = None  # every GET of it sends at most this many bytes, then hangs up
        self.slow_s: float | None = None  # every GET of it sends 1 KiB pieces this far apart
        self.sent = 0                 # body bytes of it sent, over all GETs
        self.status = {"hub": [], "cdn": []}  # the next requests to each server get these HTTP statuses

    def handler(hub, role: str):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                hub.requests.append((self.command, f"{role}:{self.path}", self.headers.get("Range")))
                name = self.path.rsplit("/", 1)[1]
                if hub.status[role]:
                    self.send_response(hub.status[role].pop(0))
                    if role == "hub":
                        self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if role == "hub" and ("/resolve/main/" not in self.path or name not in hub.files):
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = hub.files[name]
                if role == "hub" and name in hub.lfs:
                    sha = hashlib.sha256(b"not it" if hub.wrong_sha else data).hexdigest()
                    self.send_response(302)
                    self.send_header("Location", f"{hub.cdn}/cdn/{name}")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("ETag", f'"{sha}"')
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    if not hub.no_size:
                        self.send_header("X-Linked-Size", str(len(data)))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng and body:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    # the wrong range: other bytes, honestly labelled
                    shown = 0 if hub.wrong_range and name == hub.faulty else start
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {shown}-{len(data) - 1}/{len(data)}")
                    payload = data[shown:shown + len(data) - start]  # the length asked for, so the size is right
                else:
                    self.send_response(200)
                    payload = data
                if role == "hub":
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("ETag", f'"{git_blob_sha1(data)}"')
                faulty = body and name == hub.faulty
                if body:
                    payload += b"\0" * hub.extra * faulty
                    if not hub.no_length:
                        self.send_header("Content-Length", str(len(payload)))
                elif not hub.no_size:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not body:
                    return
                if faulty and hub.drop_at is not None:
                    payload, hub.drop_at = payload[:hub.drop_at], None
                elif faulty and hub.cut_at:
                    payload = payload[:hub.cut_at.pop(0)]
                elif faulty and hub.drop_every is not None:
                    payload = payload[:hub.drop_every]
                if faulty:
                    hub.sent += len(payload)
                try:
                    if faulty and hub.drip_s is not None:
                        for i in range(len(payload)):
                            self.wfile.write(payload[i:i + 1])
                            self.wfile.flush()
                            time.sleep(hub.drip_s)
                    elif faulty and hub.slow_s is not None:
                        for i in range(0, len(payload), 1024):
                            self.wfile.write(payload[i:i + 1024])
                            self.wfile.flush()
                            time.sleep(hub.slow_s)
                    else:
                        self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
                    pass
                self.close_connection = True

        return Handler


def _serve(handler) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    """huggingface_hub's user agent would otherwise ask huggingface.co for a list of AI agents: no network here."""
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture
def hub(monkeypatch):
    fake = FakeHub()
    hub_server, cdn_server = _serve(fake.handler("hub")), _serve(fake.handler("cdn"))
    fake.base = f"http://127.0.0.1:{hub_server.server_port}"
    fake.cdn = f"http://127.0.0.1:{cdn_server.server_port}"  # another origin, as the real CDN is
    monkeypatch.setenv("HF_ENDPOINT", fake.base)
    yield fake
    for server in (hub_server, cdn_server):
        server.shutdown()
        server.server_close()


def get(tmp_path, *args) -> tuple[int, str]:
    """Run the command line; returns (exit code, stderr)."""
    import contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = wd.main(["gpt2", "--dir", str(tmp_path), *args])
    return code, err.getvalue()


def cdn_gets(hub) -> list[str | None]:
    return [r[2] for r in hub.requests if r[0] == "GET" and r[1].startswith("cdn:")]


def test_every_checkpoint_has_a_hub_repo_and_a_preset(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert set(wd.REPOS) == set(HF_CHECKPOINTS) and all(n in PRESETS for n in HF_CHECKPOINTS)
    assert wd.file_url("distilgpt2", "model.safetensors") == \
        "https://huggingface.co/distilbert/distilgpt2/resolve/main/model.safetensors"


def test_hf_endpoint_overrides_the_base_url(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example/")
    assert wd.file_url("gpt2-xl", "config.json") == "http://mirror.example/openai-community/gpt2-xl/resolve/main/config.json"
    monkeypatch.delenv("HF_ENDPOINT")
    assert wd.file_url("gpt2", "model.safetensors").startswith("https://huggingface.co/openai-community/gpt2/")


def test_full_download_of_a_checkpoint(hub, tmp_path):
    code, err = get(tmp_path, "--no-progress")
    assert code == 0, err
    folder = tmp_path / "gpt2"
    assert (folder / "model.safetensors").read_bytes() == BIG
    assert (folder / "config.json").read_bytes() == SMALL
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert cdn_gets(hub) == [None]  # the big file came from the CDN, in one piece


def test_progress_bar_on_with_a_close_delimited_stream(hub, tmp_path):
    hub.no_length = True  # the tqdm of an unknown total used to crash `if bar:`
    code, err = get(tmp_path)
    assert code == 0 and "Traceback" not in err
    assert (tmp_path / "gpt2" / "model.safetensors").read_bytes() == BIG


def test_skip_when_complete(hub, tmp_path):
    assert get(tmp_path, "--no-progress")[0] == 0
    hub.requests.clear()
    code, err = get(tmp_path, "--no-progress")
    assert code == 0 and err.count("already there") == 3
    assert not any(r[0] == "GET" for r in hub.requests)


# ---- the faults of the issue: no truncated or unverified file takes its final name ----

def test_no_size_is_refused_and_nothing_is_written(hub, tmp_path):
    hub.no_size, hub.no_length, hub.cut_at = True, True, [len(BIG) // 2]
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "did not say how large" in err and "Traceback" not in err
    assert not (tmp_path / "gpt2").exists()  # no empty folder left for a loader to take for a checkpoint


def test_a_close_delimited_cut_is_resumed_not_accepted(hub, tmp_path):
    hub.no_length, hub.cut_at = True, [len(BIG) // 2]  # a cut looks like a normal end: only the size tells
    code, err = get(tmp_path, "--no-progress")
    assert code == 0, err
    assert (tmp_path / "gpt2" / "model.safetensors").read_bytes() == BIG
    assert cdn_gets(hub) == [None, f"bytes={len(BIG) // 2}-"]  # the half already there was kept


def test_cut_every_time_keeps_the_part_and_the_next_run_resumes_it(hub, tmp_path):
    hub.no_length, hub.cut_at = True, [3000] + [0] * (wd.ATTEMPTS - 1)
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "run the same command again to resume" in err and "Traceback" not in err
    folder = tmp_path / "gpt2"
    assert f"3,000 bytes kept in {folder / 'model.safetensors.part'}" in err
    assert not (folder / "model.safetensors").exists()
    assert (folder / "model.safetensors.part").read_bytes() == BIG[:3000]
    hub.requests.clear()
    assert get(tmp_path, "--no-progress")[0] == 0
    assert (folder / "model.safetensors").read_bytes() == BIG and not (folder / "model.safetensors.part").exists()
    assert cdn_gets(hub) == ["bytes=3000-"]  # only the rest was asked for


def test_a_dropped_connection_is_retried_within_one_run(hub, tmp_path):
    hub.drop_at = 5000  # Content-Length announced, then the connection closes: the hub's client retries
    assert get(tmp_path, "--no-progress")[0] == 0
    assert (tmp_path / "gpt2" / "model.safetensors").read_bytes() == BIG
    assert len(cdn_gets(hub)) == 2


def test_a_size_lie_is_never_written_past_the_announced_size(hub, tmp_path, monkeypatch):
    hub.extra = 40 << 20  # HEAD announces 10,244 bytes; the GET streams 40 MB more
    largest = []

    class Recording(io.FileIO):
        def write(self, data):
            largest.append(self.tell() + len(data))
            return super().write(data)

    monkeypatch.setattr(wd, "open_part", lambda path: Recording(path, "ab"))
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "more than the 10244 bytes it announced" in err and "Traceback" not in err
    assert max(largest, default=0) <= len(BIG)
    assert not list((tmp_path / "gpt2").glob("model.safetensors*"))  # neither the final name nor a .part


def test_a_wrong_content_range_is_refused_and_the_file_starts_over(hub, tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "model.safetensors.part").write_bytes(BIG[:3000])
    hub.wrong_range = True  # asked for bytes=3000-, answers bytes 0-… of the right length
    code, err = get(tmp_path, "--no-progress")
    assert code == 0, err
    assert "starting the file over" in err
    assert (folder / "model.safetensors").read_bytes() == BIG
    assert cdn_gets(hub) == ["bytes=3000-", None]


def test_a_slow_drip_stops_at_the_stall_deadline_and_keeps_its_part(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "STALL_SECONDS", 0.3)
    monkeypatch.setattr(wd, "STALL_BYTES", 1024)
    hub.drip_s = 0.02  # 50 bytes/s: the per-read timeout never fires
    start = time.monotonic()
    code, err = get(tmp_path, "--no-progress")
    assert time.monotonic() - start < 5
    assert code == 1 and "stalled" in err and "Traceback" not in err
    assert not (tmp_path / "gpt2" / "model.safetensors").exists()


def test_checksum_mismatch_is_rejected_and_leaves_no_file(hub, tmp_path):
    hub.wrong_sha = True
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "checksum mismatch" in err
    assert not list((tmp_path / "gpt2").glob("model.safetensors*"))


def test_a_small_file_is_verified_by_its_git_hash(hub, tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json.part").write_bytes(b'{"n_layer": 3}')  # one byte short, and wrong: resumed, then refused
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "checksum mismatch" in err and git_blob_sha1(SMALL) in err
    assert not (folder / "config.json").exists() and not (folder / "config.json.part").exists()


def test_a_complete_part_from_an_earlier_run_is_verified_and_renamed(hub, tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "model.safetensors.part").write_bytes(BIG)
    assert get(tmp_path, "--no-progress")[0] == 0
    assert (folder / "model.safetensors").read_bytes() == BIG and cdn_gets(hub) == []


def test_a_full_disk_is_one_line_and_keeps_what_was_written(hub, tmp_path, monkeypatch):
    class FullDisk(io.FileIO):  # a file that takes 4,000 bytes, then runs out of space
        def __init__(self, path):
            super().__init__(path, "ab")

        def write(self, data):
            room = 4000 - self.tell()
            if len(data) > room:
                super().write(data[:room])
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    monkeypatch.setattr(wd, "open_part", FullDisk)
    code, err = get(tmp_path, "--no-progress")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in err
    folder = tmp_path / "gpt2"
    assert not (folder / "model.safetensors").exists()
    assert (folder / "model.safetensors.part").read_bytes() == BIG[:4000]  # kept: rerun once there is room


def test_not_enough_free_space_is_said_before_downloading(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(wd.shutil, "disk_usage", lambda path: type("U", (), {"free": 10})())
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "has 10 free" in err and not any(r[0] == "GET" for r in hub.requests)


@pytest.mark.parametrize("target", ["a-file", "a-file/sub"])  # --dir is a file, or inside one
def test_a_bad_target_folder_is_one_line(hub, tmp_path, target):
    (tmp_path / "a-file").write_text("not a folder")
    code, err = get(tmp_path / target, "--no-progress")
    assert code == 1 and err.startswith("error: cannot create the folder") and len(err.splitlines()) == 1


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://host", "http://"])
def test_a_malformed_hf_endpoint_is_one_line(monkeypatch, tmp_path, endpoint):
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and err.startswith("error: HF_ENDPOINT=") and len(err.splitlines()) == 1


def test_a_server_that_is_not_a_hub_is_refused(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.cdn)  # serves the files, but says nothing of a commit
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "no X-Repo-Commit" in err and len(err.splitlines()) == 1


def test_missing_file_is_a_clean_error(hub, tmp_path):
    del hub.files["tokenizer.json"]
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "HTTP 404" in err and "Traceback" not in err
    assert (tmp_path / "gpt2" / "config.json").exists() and not (tmp_path / "gpt2" / "model.safetensors").exists()


def test_no_network_is_a_clear_message_not_a_traceback(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "cannot reach" in err and "Traceback" not in err
    assert not (tmp_path / "gpt2").exists()


def test_unknown_name_lists_the_checkpoints(capsys):
    with pytest.raises(SystemExit) as e:
        wd.main(["gpt3"])
    assert e.value.code == 2 and "gpt2-medium" in capsys.readouterr().err


# ---- two runs at once, a link that drops every MiB, a file gone bad, server errors ----

def _run_in_threads(n: int, argv: list[str]) -> tuple[list, str]:
    """`n` runs of the command line at the same moment; returns their exit codes (or exceptions) and stderr."""
    import contextlib
    start, results = threading.Barrier(n), [None] * n

    def run(i):
        start.wait()
        try:
            results[i] = wd.main(argv)
        except BaseException as e:  # noqa: BLE001 -- a raw traceback is what the test looks for
            results[i] = e

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    return results, err.getvalue()


def test_two_runs_at_once_never_leave_a_wrong_file_under_a_final_name(hub, tmp_path):
    """Without a lock, two runs would append to one .part and rename it under each other's feet."""
    hub.slow_s = 0.002  # the big file takes a few tens of ms: the runs overlap
    for trial in range(20):
        weights = tmp_path / str(trial)
        codes, err = _run_in_threads(2, ["gpt2", "--dir", str(weights), "--no-progress"])
        assert codes == [0, 0] and "Traceback" not in err, (trial, codes, err)
        folder = weights / "gpt2"
        for name, data in hub.files.items():
            assert (folder / name).read_bytes() == data, (trial, name)
        assert sorted(p.name for p in folder.iterdir()) == sorted(hub.files)


@pytest.mark.slow
def test_two_processes_at_once_never_leave_a_wrong_file_under_a_final_name(hub, tmp_path, monkeypatch):
    """The same, as two real command lines: the lock is the file system's, across processes."""
    import subprocess
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    hub.slow_s = 0.01  # about 0.1 s for the big file, against a second or two of start-up: the runs overlap
    hub.files["model.safetensors"] = BIG * 4
    waited = 0
    for trial in range(20):
        weights = tmp_path / str(trial)
        runs = [subprocess.Popen([sys.executable, str(REPO / "weights_download.py"), "gpt2", "--dir", str(weights),
                                  "--no-progress"], stderr=subprocess.PIPE, text=True) for _ in range(2)]
        errs = [run.communicate(timeout=120)[1] for run in runs]
        assert [run.returncode for run in runs] == [0, 0] and not any("Traceback" in e for e in errs), errs
        for name, data in hub.files.items():
            assert (weights / "gpt2" / name).read_bytes() == data, (trial, name)
        waited += any("waiting for it" in e for e in errs)
    print(f"the second run waited for the first in {waited} of 20 trials")


def test_a_second_run_says_that_it_waits_for_the_first(hub, tmp_path):
    from filelock import FileLock
    holder = FileLock(tmp_path / ".gpt2.lock")
    holder.acquire()  # as a first run would hold it
    err, result = io.StringIO(), []

    def second():
        import contextlib
        with contextlib.redirect_stderr(err):
            result.append(wd.main(["gpt2", "--dir", str(tmp_path), "--no-progress"]))

    thread = threading.Thread(target=second)
    thread.start()
    deadline = time.monotonic() + 20
    while "waiting" not in err.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "another weights_download.py run is filling" in err.getvalue() and not hub.requests
    holder.release()
    thread.join(timeout=30)
    assert result == [0] and (tmp_path / "gpt2" / "model.safetensors").read_bytes() == BIG


def test_a_link_that_drops_every_mib_finishes_and_sends_at_most_twice_the_file(hub, tmp_path):
    """A client that buffered 10 MiB would lose it on each drop, so every GET would start from byte 0."""
    big = hashlib.sha256(b"seed").digest() * (3 * (1 << 20) // 32) + b"tail"  # 3 MiB and 4 bytes
    hub.files["model.safetensors"], hub.drop_every = big, 1 << 20
    code, err = get(tmp_path, "--no-progress")
    assert code == 0, err
    assert (tmp_path / "gpt2" / "model.safetensors").read_bytes() == big
    assert hub.sent <= 2 * len(big), f"{hub.sent:,} bytes sent for a {len(big):,}-byte file"
    assert [int(r.removeprefix("bytes=").rstrip("-")) for r in cdn_gets(hub)[1:]] == [1 << 20, 2 << 20, 3 << 20]


def test_a_failed_download_names_no_part_file_that_does_not_exist(hub, tmp_path):
    hub.no_length, hub.cut_at = True, [0] * wd.ATTEMPTS  # nothing ever arrives
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and "no bytes were kept" in err and ".part" not in err
    assert not list((tmp_path / "gpt2").glob("*.part"))


def test_a_final_file_with_the_right_size_and_wrong_content_is_replaced(hub, tmp_path):
    """A file under its final name is not trusted by its size alone."""
    assert get(tmp_path, "--no-progress")[0] == 0
    dest = tmp_path / "gpt2" / "model.safetensors"
    dest.write_bytes(b"\0" * len(BIG))
    code, err = get(tmp_path, "--no-progress")
    assert code == 0 and "did not match the hub's checksum" in err and err.count("already there") == 2
    assert dest.read_bytes() == BIG


@pytest.mark.parametrize("role", ["hub", "cdn"])
def test_a_server_error_is_retried_with_backoff_and_named(hub, tmp_path, monkeypatch, role):
    waits = []
    monkeypatch.setattr(wd, "BACKOFF_SECONDS", (0.01, 0.02, 0.04))
    monkeypatch.setattr(wd.time, "sleep", lambda s: waits.append(s))
    hub.status[role] = [503, 500]
    code, err = get(tmp_path, "--no-progress")
    assert code == 0, err
    assert err.count("server error HTTP") == 2 and waits == [0.01, 0.02]
    assert (tmp_path / "gpt2" / "model.safetensors").read_bytes() == BIG


def test_a_server_that_keeps_failing_is_named_as_a_server_error(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "BACKOFF_SECONDS", (0.0,))
    hub.status["hub"] = [503] * wd.ATTEMPTS
    code, err = get(tmp_path, "--no-progress")
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(error) == 1 and "HTTP 503" in error[0] and "server error" in error[0]
    assert "check the model name" not in err and len(hub.requests) == wd.ATTEMPTS


@pytest.mark.parametrize("role", ["hub", "cdn"])
def test_a_403_says_access_was_refused_and_what_to_check(hub, tmp_path, role):
    hub.status[role] = [403]
    code, err = get(tmp_path, "--no-progress")
    assert code == 1 and err.count("\n") == (1 if role == "hub" else 3)  # the cdn's: after two small files
    line = err.splitlines()[-1]
    assert "refused access" in line and "HTTP 403" in line and "HF_TOKEN" in line and "None" not in line


def test_a_bad_hf_endpoint_is_one_line_before_huggingface_hub_is_imported(tmp_path):
    """huggingface_hub parses HF_ENDPOINT when imported: a bad one must not raise a traceback before our check."""
    import subprocess
    script = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
import weights_download as wd
for endpoint in ("http://127.0.0.1:99999", "http://[::1"):
    os.environ["HF_ENDPOINT"] = endpoint
    print(wd.main(["gpt2", "--dir", {str(tmp_path)!r}]))
print("huggingface_hub" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["1", "1", "False"], done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: HF_ENDPOINT=") for line in lines)
    assert "Port out of range" in lines[0] and "Invalid IPv6 URL" in lines[1]


# ---- a failed download leaves the course runnable ----

@pytest.mark.parametrize("failure", ["404", "connection refused"])
def test_after_a_failed_download_lesson_01_and_generate_run_with_one_warning(hub, tmp_path, monkeypatch, capsys,
                                                                           failure):
    from minillm import PRESETS
    from minillm.checkpoints import load as weights
    from minillm import cli
    from lessons_support import load_lesson

    monkeypatch.setitem(PRESETS, "distilgpt2", PRESETS["tiny"])  # the smallest real checkpoint, at a tiny shape
    monkeypatch.setenv("MINILLM_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.delenv("MINILLM_LESSONS_WEIGHTS_NOTE_SHOWN", raising=False)
    if failure == "404":
        del hub.files["tokenizer.json"]  # config.json arrives, then the download stops
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    assert wd.main(["distilgpt2", "--no-progress"]) == 1
    folder = tmp_path / "distilgpt2"
    assert folder.is_dir() == (failure == "404")
    capsys.readouterr()

    def one_warning(run) -> None:
        monkeypatch.setattr(weights, "_warned", set())  # a fresh process's state
        run()
        out = capsys.readouterr()
        lines = [line for line in (out.out + out.err).splitlines() if str(folder) in line]
        assert len(lines) == 1, lines
        assert "Traceback" not in out.err

    one_warning(lambda: load_lesson("02_phase_split").main(
        ["--model", "distilgpt2", "--device", "cpu", "--quick", "--out", str(tmp_path / "results")]))
    one_warning(lambda: cli.main(["generate", "--model", "distilgpt2", "--device", "cpu", "--prompt", "Hi",
                                  "--max-tokens", "3"]))

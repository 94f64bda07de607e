#!/usr/bin/env python
"""Download the official GPT-2 checkpoints into weights/<name>/.

    python weights_download.py gpt2                   # 0.55 GB
    python weights_download.py distilgpt2             # 0.35 GB: 6 layers, gpt2's vocabulary (a draft for gpt2)
    python weights_download.py gpt2-medium gpt2-xl    # 1.5 GB + 6.4 GB
    python weights_download.py gpt2 --dir /data/weights

Each checkpoint is three files from its Hugging Face hub repo (REPOS):
config.json, tokenizer.json and model.safetensors. The names are minillm's
one list, `minillm.config.HF_CHECKPOINTS`; the folder is the loader's,
`minillm.checkpoints.load.default_weights_dir()`.

What the hub's own client does
------------------------------
The HTTP is `huggingface_hub`'s, what every user of the hub already runs:
`hf_hub_url` builds the address (honouring `HF_ENDPOINT`), `get_hf_file_metadata`
asks the hub for a file's size, ETag and commit (`X-Linked-Size`,
`X-Linked-Etag`, `X-Repo-Commit`, following the hub's redirects and sending
`HF_TOKEN`), and `http_get` streams the file with a progress bar, resumes with
`Range` after a dropped connection, restarts when a server ignores `Range`, and
raises when the byte count differs from the announced size. `HF_HUB_OFFLINE=1`
blocks every request.

What this script adds, and why
------------------------------
We call `http_get` rather than `hf_hub_download(local_dir=...)`: in
huggingface_hub 2.4, `hf_hub_download` writes each file to a temporary name
that it deletes on any failure, so an interrupted gpt2-xl starts again from
zero, and it checks a file's size but never its content. On top of the client:

- One run at a time per checkpoint folder: a lock file `.<name>.lock` beside
  the folder (`filelock`, which huggingface_hub itself uses). A second run
  says that it waits, then finds the first run's files and verifies them.
- Bytes go to `<file>.part`, which survives an interruption, so rerunning the
  command asks only for the rest. The client hands bytes over in chunks of
  `huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE` (10 MiB) and drops a partial
  chunk when the connection does; we set it to CHUNK_BYTES, so a link that
  drops every MiB still moves forward, and every resume starts from the bytes
  on disk.
- A file takes its final name only after its content matches the hub's
  checksum: the SHA-256 in `X-Linked-Etag` for a large (LFS) file, the git blob
  hash in `ETag` for a small one. A file already under its final name is
  hashed again on every run, and replaced if it does not match. A file whose
  size or checksum the server does not give is refused.
- Writes stop at the announced size, so a server that sends more cannot fill
  the disk; the `.part` is deleted, since its content cannot be trusted.
- A reply to `Range: bytes=N-` that starts anywhere but N is refused before a
  byte of it is written, and the file starts over.
- The client times out a silent connection, but not one that drips a byte at
  a time; a file that receives fewer than STALL_BYTES in STALL_SECONDS stops,
  keeping its `.part`.
- A server error (HTTP 5xx) is retried after BACKOFF_SECONDS and named as the
  server's fault; 401/403 say that access was refused and what to check.
- A full disk, a `--dir` that cannot hold files, a malformed `HF_ENDPOINT`
  (checked before huggingface_hub is imported, since it reads the variable on
  import), a missing huggingface_hub or an unreachable hub end in a one-line
  `error:` (exit code 1), never a traceback.
- A run that fails leaves no folder that the loader could take for a
  checkpoint: an empty folder is removed, and the loader treats a folder
  without config.json and model.safetensors as absent.

Invariant held by the tests (against a local server that answers as the hub
does): a file under its final name is complete and verified, whatever runs at
the same time.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from urllib.parse import urlsplit

from minillm.config import HF_CHECKPOINTS as CHECKPOINTS  # torch-free to read, but the package imports torch
from minillm.checkpoints.load import default_weights_dir

REPOS = {name: f"openai-community/{name}" for name in CHECKPOINTS} | {"distilgpt2": "distilbert/distilgpt2"}
FILES = ("config.json", "tokenizer.json", "model.safetensors")  # small ones first: a bad name fails fast
DEFAULT_ENDPOINT = "https://huggingface.co"
ATTEMPTS = 4                # GETs per file in one run when the stream ends early or the server fails
BACKOFF_SECONDS = (1.0, 4.0, 16.0)  # waits before retrying a server error (HTTP 5xx)
CHUNK_BYTES = 256 << 10     # what the client writes at a time; a dropped connection loses less than this
STALL_SECONDS = 60.0        # a file that receives fewer than STALL_BYTES in this long has stalled
STALL_BYTES = 64 << 10
_SHA256 = re.compile(r"[0-9a-f]{64}")    # an LFS file's ETag: the SHA-256 of its content
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")  # a git file's ETag: sha1(b"blob <size>\0" + content)

# huggingface_hub and its HTTP library, imported by _client() only once HF_ENDPOINT has been checked.
httpx2 = hub = None


class DownloadError(Exception):
    """A download that cannot finish; the message says why and what to do."""


class _Restart(Exception):
    """The server answered a range request with other bytes: start the file over."""


def endpoint() -> str:
    """$HF_ENDPOINT (a mirror, or a local server in the tests), else the hub itself; a bad one is a DownloadError."""
    url = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    fix = f"is not a URL like {DEFAULT_ENDPOINT}; fix it or unset it"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises for a port outside 0-65535 or one that is not a number
    except ValueError as e:
        raise DownloadError(f"HF_ENDPOINT={url!r} {fix} ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DownloadError(f"HF_ENDPOINT={url!r} {fix}")
    return url


def _client() -> None:
    """Import huggingface_hub (≥ 2, which speaks httpx2) after checking HF_ENDPOINT, which it parses on import."""
    global httpx2, hub
    endpoint()
    if hub is not None:
        return
    try:
        import httpx2 as _httpx2
        import huggingface_hub as _hub
        from huggingface_hub import constants, errors, file_download, utils  # noqa: F401 -- used as hub.<name>
    except ImportError as e:
        raise DownloadError(f"weights_download.py needs huggingface_hub 2 and httpx2 ({e}); install them with "
                            "`python -m pip install 'huggingface_hub>=2,<3' 'httpx2>=2,<3'`") from None
    _hub.constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES  # read by http_get on each call
    httpx2, hub = _httpx2, _hub


def file_url(name: str, filename: str) -> str:
    _client()
    return hub.hf_hub_url(REPOS[name], filename, endpoint=endpoint())


def open_part(path: Path):
    """The `.part` file, opened to append (the tests swap in a file that runs out of space)."""
    return open(path, "ab")


# ---- the guard on huggingface_hub's HTTP client ------------------------------

def _stall_watch(stream, host: str):
    """A response body that raises once fewer than STALL_BYTES arrive in STALL_SECONDS. (A connection that
    sends nothing at all is the client's own read timeout, HF_HUB_DOWNLOAD_TIMEOUT.)"""

    class StallWatch(httpx2.SyncByteStream):
        def __iter__(self):
            since, got = time.monotonic(), 0
            for chunk in stream:
                got += len(chunk)
                if time.monotonic() - since >= STALL_SECONDS:
                    if got < STALL_BYTES:
                        raise DownloadError(f"the download from {host} stalled: {got} bytes in the last "
                                            f"{STALL_SECONDS:g} s; run the same command again to resume")
                    since, got = time.monotonic(), 0
                yield chunk

        def close(self) -> None:
            stream.close()

    return StallWatch()


def _guard(response) -> None:
    """Every response the hub's client receives: the range must be the one asked for, the body must flow."""
    asked = response.request.headers.get("Range")
    if response.status_code == 206 and asked:
        start = asked.removeprefix("bytes=").split("-")[0]
        got = response.headers.get("Content-Range", "")
        if not got.startswith(f"bytes {start}-"):
            raise _Restart(f"asked for {asked}, the server sent {got or 'no Content-Range'}")
    response.stream = _stall_watch(response.stream, response.request.url.host)


def _install_guard() -> None:
    session = hub.get_session()  # huggingface_hub's shared client, with its own hooks and redirects
    if _guard not in session.event_hooks["response"]:
        session.event_hooks = {**session.event_hooks, "response": [*session.event_hooks["response"], _guard]}


def _http_status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return response.status_code if response is not None else None


def _refused(status: int, url: str) -> DownloadError:
    """The message for an HTTP error that retrying will not fix."""
    if status in (401, 403):
        return DownloadError(f"the server refused access to {url} (HTTP {status}): the repo is gated or private, "
                             "or HF_TOKEN is wrong or lacks access; check HF_TOKEN (or unset it), and HF_ENDPOINT")
    if status == 404:
        return DownloadError(f"there is no such file at {url} (HTTP 404); check the model name and HF_ENDPOINT")
    return DownloadError(f"the hub answered HTTP {status} for {url}; check the model name and HF_ENDPOINT")


def _server_failed(status: int, url: str, tries: int) -> DownloadError:
    return DownloadError(f"the server failed with HTTP {status} for {url}, {tries} times in a row: a server error, "
                         "not a wrong name or a broken network; try again later, or another HF_ENDPOINT")


def _wait_for_server(status: int, url: str, attempt: int) -> None:
    wait = BACKOFF_SECONDS[min(attempt, len(BACKOFF_SECONDS)) - 1]
    print(f"server error HTTP {status} for {url}; retrying in {wait:g} s", file=sys.stderr)
    time.sleep(wait)


# ---- one file -----------------------------------------------------------------

class _PartFile:
    """The `.part` being written: never past `size` bytes, and a failed write is a DownloadError."""

    def __init__(self, path: Path, size: int):
        self.path, self.size, self.overflow = path, size, False
        try:
            self.file = open_part(path)
        except OSError as e:
            raise DownloadError(f"cannot write {path}: {e.strerror or e}; choose a writable --dir") from None

    def write(self, data: bytes) -> int:
        if self.file.tell() + len(data) > self.size:
            self.overflow = True
            raise DownloadError(f"the server sent more than the {self.size} bytes it announced for {self.path.name}; "
                                "deleted the partial file, run the command again")
        try:
            return self.file.write(data)
        except OSError as e:
            raise self._failed(e) from None

    def _failed(self, e: OSError) -> DownloadError:
        return DownloadError(f"writing {self.path} failed ({e.strerror or e}); free some disk space or choose "
                             "another --dir, then run the same command again to resume")

    def tell(self) -> int:
        return self.file.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        return self.file.truncate(size)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.file.close()
        except OSError as e:  # a buffered write can fail only here
            if exc[0] is None:
                raise self._failed(e) from None
        if self.overflow or (self.path.is_file() and self.path.stat().st_size == 0):
            self.path.unlink(missing_ok=True)


def _metadata(url: str):
    """The hub's size and checksum for `url`, or a DownloadError that says what is wrong."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            meta = hub.get_hf_file_metadata(url, timeout=30)
            break
        except hub.errors.OfflineModeIsEnabled:
            raise DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it") from None
        except hub.errors.HfHubHTTPError as e:
            status = _http_status(e) or 0
            if status < 500:
                raise _refused(status, url) from None
            if attempt == ATTEMPTS:
                raise _server_failed(status, url, attempt) from None
            _wait_for_server(status, url, attempt)
        except httpx2.HTTPError as e:
            raise DownloadError(f"cannot reach {url} ({type(e).__name__}: {e}). Check the network connection, or "
                                "set HF_ENDPOINT to a reachable mirror. Without the download, minillm runs on random "
                                "weights.") from None
    if meta.commit_hash is None:
        raise DownloadError(f"the answer for {url} has no X-Repo-Commit header, so it does not come from a Hugging "
                            "Face hub; check HF_ENDPOINT and any proxy")
    if meta.size is None:
        raise DownloadError(f"the hub did not say how large {url} is, so a complete download could not be told "
                            "from a truncated one; refusing it (try again later, or another HF_ENDPOINT)")
    if not (_SHA256.fullmatch(meta.etag or "") or _GIT_SHA1.fullmatch(meta.etag or "")):
        raise DownloadError(f"the hub gave no checksum for {url} (ETag {meta.etag!r}), so the download could not "
                            "be verified; refusing it (check HF_ENDPOINT)")
    return meta


def checksum(path: Path, etag: str) -> str:
    """The digest of `path` in the ETag's scheme: SHA-256 of the content, or git's blob hash."""
    if _SHA256.fullmatch(etag):
        h = hashlib.sha256()
    else:
        h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def download_file(name: str, filename: str, folder: Path) -> str:
    """Make `folder/filename` a complete, verified copy of the hub's file. Returns what happened."""
    dest, part = folder / filename, folder / (filename + ".part")
    url = file_url(name, filename)
    meta = _metadata(url)
    replaced = ""
    if dest.is_file():
        if dest.stat().st_size == meta.size and checksum(dest, meta.etag) == meta.etag:
            return "already there (checksum verified)"
        dest.unlink()
        replaced = f" (the {filename} that was there did not match the hub's checksum {meta.etag}; replaced)"
    if _size(part) > meta.size:
        part.unlink()
    free = shutil.disk_usage(folder).free
    if meta.size - _size(part) > free:
        raise DownloadError(f"{filename} needs {meta.size - _size(part):,} more bytes but {folder} has {free:,} "
                            "free; free some space or choose another --dir")
    headers = hub.utils.build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a CDN gets no hub token
    for attempt in range(1, ATTEMPTS + 1):
        have = _size(part)  # the bytes on disk, whatever an earlier attempt or run believed
        if have == meta.size:
            break
        try:
            with _PartFile(part, meta.size) as f:
                hub.file_download.http_get(meta.location, f, resume_size=have, expected_size=meta.size,
                                           headers=headers, displayed_filename=f"{name}/{filename}")
            break
        except _Restart as e:
            part.unlink(missing_ok=True)
            reason = f"{e}; starting the file over"
        except hub.errors.HfHubHTTPError as e:
            status = _http_status(e) or 0
            if status < 500:
                raise _refused(status, meta.location) from None
            if attempt == ATTEMPTS:
                raise _server_failed(status, meta.location, attempt) from None
            _wait_for_server(status, meta.location, attempt)
            continue
        except (OSError, httpx2.HTTPError) as e:  # the stream ended early, or the hub's own retries gave up
            reason = str(e).splitlines()[0]
        have = _size(part)
        if attempt == ATTEMPTS:
            kept = (f"run the same command again to resume from the {have:,} bytes kept in {part}" if have
                    else "no bytes were kept; run the same command again")
            raise DownloadError(f"download of {url} stopped after {have:,} of {meta.size:,} bytes ({reason}); {kept}")
        print(f"{name}/{filename}: {reason}; resuming from byte {have:,}", file=sys.stderr)
    got = checksum(part, meta.etag)
    if got != meta.etag:
        part.unlink()
        raise DownloadError(f"checksum mismatch for {url}: the hub says {meta.etag}, the download hashes to {got}; "
                            "deleted it, run the command again")
    os.replace(part, dest)
    return "downloaded and verified" + replaced


# ---- one checkpoint -------------------------------------------------------------

def _locked(folder: Path):
    """The lock of one checkpoint folder; a second run says that it waits, and waits."""
    from filelock import FileLock, Timeout  # comes with huggingface_hub

    lock = FileLock(folder.parent / f".{folder.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"another weights_download.py run is filling {folder} (it holds {lock.lock_file}); waiting for it "
              "to finish", file=sys.stderr, flush=True)
        lock.acquire()
    return lock


def download_checkpoint(name: str, weights_dir: Path | None = None, progress: bool = True) -> Path:
    """Fetch config.json, tokenizer.json and model.safetensors of one checkpoint into `<weights_dir>/<name>/`."""
    if name not in CHECKPOINTS:
        raise DownloadError(f"unknown checkpoint {name!r}; choose from {', '.join(CHECKPOINTS)}")
    _client()
    folder = Path(weights_dir or default_weights_dir()) / name
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = _locked(folder)
    except OSError as e:
        raise DownloadError(f"cannot create the folder {folder}: {e.strerror or e}; choose another --dir") from None
    try:
        try:
            folder.mkdir(exist_ok=True)  # under the lock: an earlier run may have just removed its empty folder
        except OSError as e:
            raise DownloadError(f"cannot create the folder {folder}: {e.strerror or e}; choose another --dir") from None
        if not os.access(folder, os.W_OK):
            raise DownloadError(f"the folder {folder} is not writable; choose another --dir")
        if hub.is_offline_mode():
            raise DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it")
        _install_guard()
        with nullcontext() if progress else hub.utils.disable_progress_bars():
            for filename in FILES:
                print(f"{name}/{filename}: {download_file(name, filename, folder)}", file=sys.stderr)
    finally:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # a failed first run leaves nothing that looks like a checkpoint
        lock.release()
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Download official GPT-2 checkpoints for minillm.")
    parser.add_argument("names", nargs="+", metavar="name", help=f"one or more of: {', '.join(CHECKPOINTS)}")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the checkpoint folders go (default: $MINILLM_WEIGHTS_DIR or weights/ "
                             "beside this script)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in CHECKPOINTS]
    if unknown:
        parser.error(f"unknown checkpoint {', '.join(unknown)}; choose from {', '.join(CHECKPOINTS)}")
    try:
        for name in args.names:
            folder = download_checkpoint(name, args.dir, progress=not args.no_progress)
            print(f"{name}: ready in {folder}", file=sys.stderr)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

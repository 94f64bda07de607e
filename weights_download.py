#!/usr/bin/env python
"""Download the official GPT-2 checkpoints into weights/<name>/.

    python weights_download.py gpt2                   # 0.55 GB
    python weights_download.py gpt2-medium gpt2-xl    # 1.5 GB + 6.4 GB
    python weights_download.py gpt2 --dir /data/weights

Each checkpoint is three files from the Hugging Face hub repo
openai-community/<name>: config.json, tokenizer.json and model.safetensors.

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

- Bytes go to `<file>.part`, which survives an interruption, so rerunning the
  command asks only for the rest; a stream that ends early (a server that
  closes the connection instead of sending `Content-Length`) is resumed the
  same way, a few times, within one run.
- A file takes its final name only after its content matches the hub's
  checksum: the SHA-256 in `X-Linked-Etag` for a large (LFS) file, the git blob
  hash in `ETag` for a small one. A file whose size or checksum the server does
  not give is refused, so a truncated or wrong file never takes the final name.
- Writes stop at the announced size, so a server that sends more cannot fill
  the disk; the `.part` is deleted, since its content cannot be trusted.
- A reply to `Range: bytes=N-` that starts anywhere but N is refused before a
  byte of it is written, and the file starts over.
- The client times out a silent connection, but not one that drips a byte at
  a time; a file that receives fewer than STALL_BYTES in STALL_SECONDS stops,
  keeping its `.part`.
- A full disk, a `--dir` that cannot hold files, a malformed `HF_ENDPOINT` or
  an unreachable hub end in a one-line `error:` (exit code 1), never a traceback.

Invariant held by the tests (against a local server that answers as the hub
does): a file under its final name is complete and verified.
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

import httpx2  # huggingface_hub's HTTP library: the stall watch wraps its response streams
from huggingface_hub import get_hf_file_metadata, get_session, hf_hub_url, is_offline_mode
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers, disable_progress_bars

CHECKPOINTS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # = minillm.config.HF_CHECKPOINTS
FILES = ("config.json", "tokenizer.json", "model.safetensors")  # small ones first: a bad name fails fast
REPO_OWNER = "openai-community"
DEFAULT_ENDPOINT = "https://huggingface.co"
ATTEMPTS = 4                # GETs per file in one run when the stream ends early
STALL_SECONDS = 60.0        # a file that receives fewer than STALL_BYTES in this long has stalled
STALL_BYTES = 64 << 10
_SHA256 = re.compile(r"[0-9a-f]{64}")    # an LFS file's ETag: the SHA-256 of its content
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")  # a git file's ETag: sha1(b"blob <size>\0" + content)


class DownloadError(Exception):
    """A download that cannot finish; the message says why and what to do."""


class _Restart(Exception):
    """The server answered a range request with other bytes: start the file over."""


def endpoint() -> str:
    """$HF_ENDPOINT (a mirror, or a local server in the tests), else the hub itself."""
    url = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DownloadError(f"HF_ENDPOINT={url!r} is not a URL like {DEFAULT_ENDPOINT}; fix it or unset it")
    return url


def file_url(name: str, filename: str) -> str:
    return hf_hub_url(f"{REPO_OWNER}/{name}", filename, endpoint=endpoint())


def default_dir() -> Path:
    """$MINILLM_WEIGHTS_DIR, else weights/ beside this script (where minillm.load_model looks)."""
    env = os.environ.get("MINILLM_WEIGHTS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "weights"


def open_part(path: Path):
    """The `.part` file, opened to append (the tests swap in a file that runs out of space)."""
    return open(path, "ab")


# ---- the guard on huggingface_hub's HTTP client ------------------------------

class _StallWatch(httpx2.SyncByteStream):
    """A response body that raises once fewer than STALL_BYTES arrive in STALL_SECONDS. (A connection that
    sends nothing at all is the client's own read timeout, HF_HUB_DOWNLOAD_TIMEOUT.)"""

    def __init__(self, stream: httpx2.SyncByteStream, host: str):
        self.stream, self.host = stream, host

    def __iter__(self):
        since, got = time.monotonic(), 0
        for chunk in self.stream:
            got += len(chunk)
            if time.monotonic() - since >= STALL_SECONDS:
                if got < STALL_BYTES:
                    raise DownloadError(f"the download from {self.host} stalled: {got} bytes in the last "
                                        f"{STALL_SECONDS:g} s; run the same command again to resume")
                since, got = time.monotonic(), 0
            yield chunk

    def close(self) -> None:
        self.stream.close()


def _guard(response: httpx2.Response) -> None:
    """Every response the hub's client receives: the range must be the one asked for, the body must flow."""
    asked = response.request.headers.get("Range")
    if response.status_code == 206 and asked:
        start = asked.removeprefix("bytes=").split("-")[0]
        got = response.headers.get("Content-Range", "")
        if not got.startswith(f"bytes {start}-"):
            raise _Restart(f"asked for {asked}, the server sent {got or 'no Content-Range'}")
    response.stream = _StallWatch(response.stream, response.request.url.host)


def _install_guard() -> None:
    session = get_session()  # huggingface_hub's shared client, with its own hooks and redirects
    if _guard not in session.event_hooks["response"]:
        session.event_hooks = {**session.event_hooks, "response": [*session.event_hooks["response"], _guard]}


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
    try:
        meta = get_hf_file_metadata(url, timeout=30)
    except OfflineModeIsEnabled:
        raise DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise DownloadError(f"the hub answered HTTP {status} for {url}; check the model name and HF_ENDPOINT") from None
    except httpx2.HTTPError as e:
        raise DownloadError(f"cannot reach {url} ({type(e).__name__}: {e}). Check the network connection, or set "
                            "HF_ENDPOINT to a reachable mirror. Without the download, minillm runs on random "
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


def download_file(name: str, filename: str, folder: Path) -> str:
    """Make `folder/filename` a complete, verified copy of the hub's file. Returns what happened."""
    dest, part = folder / filename, folder / (filename + ".part")
    url = file_url(name, filename)
    meta = _metadata(url)
    if dest.is_file() and dest.stat().st_size == meta.size:
        return "already there"  # it was verified before it took this name
    if part.is_file() and part.stat().st_size > meta.size:
        part.unlink()
    have = part.stat().st_size if part.is_file() else 0
    free = shutil.disk_usage(folder).free
    if meta.size - have > free:
        raise DownloadError(f"{filename} needs {meta.size - have:,} more bytes but {folder} has {free:,} free; "
                            "free some space or choose another --dir")
    headers = build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a CDN gets no hub token
    for attempt in range(1, ATTEMPTS + 1):
        have = part.stat().st_size if part.is_file() else 0
        if have == meta.size:
            break
        try:
            with _PartFile(part, meta.size) as f:
                http_get(meta.location, f, resume_size=have, expected_size=meta.size, headers=headers,
                         displayed_filename=f"{name}/{filename}")
            break
        except _Restart as e:
            part.unlink(missing_ok=True)
            reason = f"{e}; starting the file over"
        except (OSError, httpx2.HTTPError) as e:  # the stream ended early, or the hub's own retries gave up
            reason = str(e).splitlines()[0]
        have = part.stat().st_size if part.is_file() else 0
        if attempt == ATTEMPTS:
            raise DownloadError(f"download of {url} stopped after {have:,} of {meta.size:,} bytes ({reason}); "
                                f"run the same command again to resume from {part}")
        print(f"{name}/{filename}: {reason}; resuming from byte {have:,}", file=sys.stderr)
    got = checksum(part, meta.etag)
    if got != meta.etag:
        part.unlink()
        raise DownloadError(f"checksum mismatch for {url}: the hub says {meta.etag}, the download hashes to {got}; "
                            "deleted it, run the command again")
    os.replace(part, dest)
    return "downloaded and verified"


def download_checkpoint(name: str, weights_dir: Path | None = None, progress: bool = True) -> Path:
    """Fetch config.json, tokenizer.json and model.safetensors of one checkpoint into `<weights_dir>/<name>/`."""
    if name not in CHECKPOINTS:
        raise DownloadError(f"unknown checkpoint {name!r}; choose from {', '.join(CHECKPOINTS)}")
    folder = Path(weights_dir or default_dir()) / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DownloadError(f"cannot create the folder {folder}: {e.strerror or e}; choose another --dir") from None
    if not os.access(folder, os.W_OK):
        raise DownloadError(f"the folder {folder} is not writable; choose another --dir")
    if is_offline_mode():
        raise DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it")
    _install_guard()
    with nullcontext() if progress else disable_progress_bars():
        for filename in FILES:
            print(f"{name}/{filename}: {download_file(name, filename, folder)}", file=sys.stderr)
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

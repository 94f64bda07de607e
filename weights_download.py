#!/usr/bin/env python
"""Download the official GPT-2 checkpoints into weights/<name>/.

    python weights_download.py gpt2                   # 0.55 GB
    python weights_download.py gpt2-medium gpt2-xl    # 1.5 GB + 6.4 GB
    python weights_download.py gpt2 --dir /data/weights

Each checkpoint is three files from the Hugging Face hub repo
openai-community/<name>: config.json, tokenizer.json and model.safetensors.
`HF_ENDPOINT` replaces https://huggingface.co (a mirror, or a local server in
the tests), as it does for the hub's own client.

How a file arrives safely
-------------------------
1. Ask first. A HEAD request on the file's `resolve` URL, without following
   the redirect to the storage CDN, returns what the hub knows: for a large
   (LFS) file `X-Linked-Size` and `X-Linked-Etag`, the quoted SHA-256 of the
   content; for a small file kept in git, `Content-Length` and a git hash.
   This is how the hub's own client reads file metadata.
2. Stream into `<file>.part`. If a `.part` is already there from an
   interrupted run, ask only for the rest with `Range: bytes=<have>-`.
   A dropped connection is resumed the same way, a few times, before giving up.
3. Check the size, and the SHA-256 when the hub reported one. Only then
   rename `.part` to the final name, so a file under its final name is always
   complete and verified; a mismatch deletes the `.part` and fails.
4. A file already present at the reported size is skipped.

Standard library plus tqdm only, so it runs before anything else is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is a nicety, not a requirement
    tqdm = None

CHECKPOINTS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # = minillm.config.HF_CHECKPOINTS
FILES = ("config.json", "tokenizer.json", "model.safetensors")  # small ones first: a bad name fails fast
REPO_OWNER = "openai-community"
DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DownloadError(Exception):
    """A download that cannot finish; the message says why and what to do."""


@dataclass
class RemoteFile:
    url: str
    size: int | None      # bytes, when the server said
    sha256: str | None    # hex digest, when the server said (LFS files)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def file_url(name: str, filename: str, base: str | None = None) -> str:
    return f"{base or endpoint()}/{REPO_OWNER}/{name}/resolve/main/{filename}"


def default_dir() -> Path:
    """$MINILLM_WEIGHTS_DIR, else weights/ beside this script (where minillm.load_model looks)."""
    env = os.environ.get("MINILLM_WEIGHTS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "weights"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # surface the 3xx itself: its headers carry the file's metadata


def _unreachable(url: str, err: Exception) -> DownloadError:
    reason = getattr(err, "reason", err)
    return DownloadError(f"cannot reach {url} ({reason}). Check the network connection, or set HF_ENDPOINT "
                         "to a reachable mirror. Without the download, minillm runs on random weights.")


def _http_error(url: str, err: urllib.error.HTTPError) -> DownloadError:
    return DownloadError(f"the server answered HTTP {err.code} {err.reason} for {url}; "
                         "check the model name and HF_ENDPOINT")


def _normalize_etag(etag: str | None) -> str | None:
    if not etag:
        return None
    etag = etag.strip().removeprefix("W/").strip('"').lower()
    return etag if _SHA256.fullmatch(etag) else None


def remote_info(url: str, timeout: float = 30.0, max_hops: int = 5) -> RemoteFile:
    """HEAD the file: its size and (for LFS files) its SHA-256, following only relative redirects."""
    opener = urllib.request.build_opener(_NoRedirect)
    for _ in range(max_hops):
        req = urllib.request.Request(url, method="HEAD",
                                     headers={"Accept-Encoding": "identity", "User-Agent": "minillm-download"})
        try:
            with opener.open(req, timeout=timeout) as resp:
                headers, redirect = resp.headers, False
        except urllib.error.HTTPError as e:
            if e.code not in (301, 302, 303, 307, 308):
                raise _http_error(url, e) from None
            headers, redirect = e.headers, True
            location = headers.get("Location", "")
            if location.startswith("/"):  # a renamed repo on the hub itself: follow it
                url = urljoin(url, location)
                continue
        except (urllib.error.URLError, OSError) as e:
            raise _unreachable(url, e) from None
        size = headers.get("X-Linked-Size") or (None if redirect else headers.get("Content-Length"))
        sha = _normalize_etag(headers.get("X-Linked-Etag") or headers.get("ETag"))
        return RemoteFile(url, int(size) if size is not None else None, sha)
    raise DownloadError(f"too many redirects for {url}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _fetch(info: RemoteFile, part: Path, label: str, timeout: float, progress: bool) -> None:
    """One GET into `part`, resuming from its current size; raises ConnectionError if cut short."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"Accept-Encoding": "identity", "User-Agent": "minillm-download"}
    if have:
        headers["Range"] = f"bytes={have}-"
    req = urllib.request.Request(info.url, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416:  # our .part does not fit the file any more: start over
            part.unlink()
            raise ConnectionError("the partial file did not match the remote one; restarting") from None
        raise _http_error(info.url, e) from None
    with resp:
        if have and resp.status != 206:  # the server ignored Range: take the whole file again
            have = 0
        length = resp.headers.get("Content-Length")
        expected = int(length) if length is not None else None
        bar = None
        if progress and tqdm is not None:
            bar = tqdm(total=info.size, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=label, leave=True)
        received = 0
        try:
            with open(part, "ab" if have else "wb") as f:
                while block := resp.read(CHUNK):
                    f.write(block)
                    received += len(block)
                    if bar:
                        bar.update(len(block))
        finally:
            if bar:
                bar.close()
    # http.client returns b"" when the server closes early, so count the bytes ourselves.
    if expected is not None and received < expected:
        raise ConnectionError(f"connection closed after {have + received} bytes")


def download_file(url: str, dest: Path, timeout: float = 30.0, retries: int = 3, progress: bool = True) -> str:
    """Make `dest` a complete, verified copy of `url`. Returns "skipped" or "downloaded"."""
    dest = Path(dest)
    info = remote_info(url, timeout)
    if dest.exists() and (info.size is None or dest.stat().st_size == info.size):
        return "skipped"
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    if part.exists() and info.size is not None and part.stat().st_size > info.size:
        part.unlink()
    for attempt in range(retries + 1):
        if part.exists() and info.size is not None and part.stat().st_size == info.size:
            break  # a previous run got every byte but stopped before the rename
        try:
            _fetch(info, part, f"{dest.parent.name}/{dest.name}", timeout, progress)
            break
        except (ConnectionError, TimeoutError, http.client.HTTPException, urllib.error.URLError) as e:
            if isinstance(e, urllib.error.URLError) and attempt == 0 and not part.exists():
                raise _unreachable(url, e) from None
            have = part.stat().st_size if part.exists() else 0
            if attempt == retries:
                raise DownloadError(f"download of {url} interrupted after {have} of {info.size or '?'} bytes "
                                    f"({e}); run the same command again to resume from {part}") from None
            print(f"{dest.name}: {e}; resuming from byte {have}", file=sys.stderr)
    _verify(info, part)
    os.replace(part, dest)
    return "downloaded"


def _verify(info: RemoteFile, part: Path) -> None:
    """Size, then SHA-256 when known; a bad file is deleted, never renamed."""
    size = part.stat().st_size
    if info.size is not None and size != info.size:
        part.unlink()
        raise DownloadError(f"{part} has {size} bytes but the server announced {info.size}; "
                            "deleted it, run the command again")
    if info.sha256 is not None:
        got = sha256_of(part)
        if got != info.sha256:
            part.unlink()
            raise DownloadError(f"checksum mismatch for {info.url}: expected sha256 {info.sha256}, got {got}; "
                                "deleted the download, run the command again")


def download_checkpoint(name: str, weights_dir: Path | None = None, **kwargs) -> Path:
    """Fetch config.json, tokenizer.json and model.safetensors of one checkpoint."""
    if name not in CHECKPOINTS:
        raise DownloadError(f"unknown checkpoint {name!r}; choose from {', '.join(CHECKPOINTS)}")
    folder = Path(weights_dir or default_dir()) / name
    for filename in FILES:
        outcome = download_file(file_url(name, filename), folder / filename, **kwargs)
        print(f"{name}/{filename}: {outcome}", file=sys.stderr)
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

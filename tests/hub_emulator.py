"""A Hugging Face Hub stand-in on a loopback port, in this process: the endpoints huggingface_hub's create_repo and
upload_folder call (repo creation, preupload, the NDJSON commit, the tree listing of delete_patterns), every request
recorded. Files are always answered "regular" (sent inline in the commit): no LFS or Xet storage is emulated.

    with HubEmulator() as hub:            # http://127.0.0.1:PORT, shut down on exit
        hub.fail["commit"] = 403           # answer one endpoint with an error instead
        ...
        hub.repos["tester/name"].files     # {path: bytes} after the commits
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

USER = "tester"  # the namespace of a repository created without one


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclasses.dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    commits: list[str] = dataclasses.field(default_factory=list)  # commit summaries, in order


REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (method, path pattern, endpoint name)
    ("POST", r"/api/repos/create", "create"),
    ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "commit"),
    ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?P<sub>/.*)?", "tree"),
    ("POST", r"/api/validate-yaml", "validate-yaml"),
    ("GET", r"/api/whoami-v2", "whoami"),
]


class HubEmulator:
    def __init__(self):
        self.requests: list[Request] = []
        self.repos: dict[str, Repo] = {}
        self.fail: dict[str, int] = {}  # endpoint name -> HTTP status to answer instead
        self._lock = threading.Lock()
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                emulator._handle(self)

            def do_POST(self):
                emulator._handle(self)

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-emulator", daemon=True)

    def __enter__(self) -> HubEmulator:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def calls(self, name: str) -> list[Request]:
        """The recorded requests to one endpoint (a ROUTES name)."""
        return [r for r in self.requests if _route(r.method, r.path)[0] == name]

    # -- requests --------------------------------------------------------------------------------------------------
    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        request = Request(
            handler.command,
            unquote(url.path),
            parse_qs(url.query),
            {k.lower(): v for k, v in handler.headers.items()},
            _read_body(handler),
        )
        with self._lock:
            self.requests.append(request)
            name, match = _route(request.method, request.path)
            if name is None:
                status, answer = 404, {"error": f"no route {request.method} {request.path}"}
            elif name in self.fail:
                status, answer = self.fail[name], {"error": f"{name} refused by the emulator"}
            else:
                status, answer = getattr(self, "_" + name.replace("-", "_"))(request, **match)
        data = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if status >= 400:
            handler.send_header("X-Error-Message", answer["error"])
        handler.end_headers()
        handler.wfile.write(data)

    def _create(self, request: Request):
        payload = request.json()
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
        self.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def _repo(self, repo: str) -> Repo | None:
        return self.repos.get(repo)

    def _preupload(self, request: Request, repo: str, rev: str):
        if self._repo(repo) is None:
            return 404, {"error": "Repository not found"}
        return 200, {
            "files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in request.json()["files"]
            ]
        }

    def _commit(self, request: Request, repo: str, rev: str):
        target = self._repo(repo)
        if target is None:
            return 404, {"error": "Repository not found"}
        lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        files = dict(target.files)
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
            elif line["key"] == "deletedFolder":
                files = {p: b for p, b in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                return 400, {"error": f"the emulator does not take {line['key']} operations"}
        target.files = files
        target.commits.append(lines[0]["value"]["summary"])
        oid = hashlib.sha1(f"{repo}{len(target.commits)}".encode()).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True}

    def _tree(self, request: Request, repo: str, rev: str, sub: str | None):
        target = self._repo(repo)
        if target is None:
            return 404, {"error": "Repository not found"}
        prefix = (sub or "").strip("/")
        return 200, [
            {"type": "file", "path": path, "size": len(data), "oid": _git_oid(data)}
            for path, data in sorted(target.files.items())
            if path.startswith(prefix)
        ]

    def _validate_yaml(self, request: Request):
        return 200, {"errors": [], "warnings": []}

    def _whoami(self, request: Request):
        return 200, {"type": "user", "name": USER}


def _route(method: str, path: str):
    for route_method, pattern, name in ROUTES:
        match = re.fullmatch(pattern, path)
        if match and method == route_method:
            return name, match.groupdict()
    return None, {}


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while size := int(handler.rfile.readline().strip() or b"0", 16):
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
        handler.rfile.readline()
        return b"".join(chunks)
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

"""A minimal Hub-compatible HTTP endpoint for offline publishing tests.

It implements the part of the Hub API that huggingface_hub's client uses to create a repository, upload files through
the preupload + commit endpoints, create branches, and serve files back through ``/{repo}/resolve/{revision}/{path}``.

Uploads take the paths the real Hub assigns them:

- text files are "regular": their content travels base64-encoded inside the commit (``"key": "file"``);
- weights and other binary files are "lfs" (as the Hub's default ``.gitattributes`` and binary detection decide):
  preupload answers ``"uploadMode": "lfs"``, the client asks the LFS batch API
  (``POST /{repo}.git/info/lfs/objects/batch``) for an upload action, PUTs the bytes to the ``href`` it names (a
  separate "storage" listener standing in for S3, with a one-time token in the URL like a presigned URL), calls the
  verify action, and the commit only carries an ``lfsFile`` pointer (sha256 oid + size). A commit that names an
  object the storage does not hold, or that commits a binary file as a regular blob, is rejected like on the Hub.
- downloads of an LFS file get a 302 from ``resolve`` to the storage host, carrying ``X-Repo-Commit``,
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``, with ``ETag`` the git oid of the pointer file; the client then
  GETs the object from storage. Regular files are served directly with their git blob oid as ``ETag``.

The Hub's other upload transport, Xet, is not implemented: tests must set ``HF_HUB_DISABLE_XET`` so that the client
takes the LFS batch path (the one it takes whenever ``hf_xet`` is not installed). Any request this server does not
implement (a Xet token request included) is answered 404 and recorded in ``unknown``; tests assert it stays empty.

Dataset repositories (``repo_type="dataset"``) take the same routes under ``/datasets/...`` and ``/api/datasets/...``,
kept apart from model repositories; ``GET .../tree/{revision}[/{folder}]`` lists a revision's files (one page), as
``datasets.load_dataset`` asks.

Both listeners bind to 127.0.0.1 on free ports and are shut down when the context manager exits. Files are kept in
memory per repository and revision.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

# A subset of the Hub's default .gitattributes for model repos: these are always stored in LFS.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.msgpack", "*.npy", "*.npz",
                "*.pkl", "*.pickle", "*.gguf", "*.tflite", "*.model", "*.zip", "*.tar", "*.gz", "*.zst", "*.arrow",
                "*.parquet", "*tfevents*")  # fmt: skip
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub refuses regular blobs above 10 MB
LFS_CONTENT_TYPE = "application/vnd.git-lfs+json"


def should_be_lfs(path: str, size: int, sample: bytes) -> bool:
    """The Hub's decision: LFS for tracked patterns, large files and binary content; never for empty files."""
    if size == 0:
        return False
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS) or size >= LFS_SIZE_THRESHOLD or b"\0" in sample


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def _revision_sha(files: dict) -> str:
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
    return digest.hexdigest()


def _find_revision(repo: dict, rev: str) -> str | None:
    """Branch name for a branch name or a commit sha (the client resolves files by the sha it was given)."""
    if rev in repo["revisions"]:
        return rev
    for name, files in repo["revisions"].items():
        if _revision_sha(files) == rev:
            return name
    return None


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body=b"", headers=None, content_type="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code, obj, headers=None, content_type="application/json"):
        self._send(code, json.dumps(obj).encode(), headers, content_type)

    def _body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _path(self):
        return unquote(urlparse(self.path).path)

    def _query(self):
        return parse_qs(urlparse(self.path).query)


class LocalHub:
    def __init__(self):
        # repo_id -> {"private": bool, "revisions": {rev: {path: bytes}}, "pointers": {rev: {path: lfs oid}}}
        self.repos: dict[str, dict] = {}
        # one per commit: repo, revision, summary, oid, and which paths came as "regular" blobs / "lfs" pointers
        self.commits: list[dict] = []
        self.unknown: list[str] = []
        self.validated: list[str] = []
        self.preuploads: dict[str, str] = {}  # path -> the upload mode this server answered (last one wins)
        self.lfs_objects: dict[str, bytes] = {}  # sha256 oid -> content held by the storage
        self.lfs_batches: list[dict] = []  # the LFS batch requests: repo, oids
        self.lfs_uploads: list[dict] = []  # the PUTs the storage accepted: oid, size
        self.lfs_verified: list[str] = []  # oids the client verified after uploading
        self.lfs_downloads: list[str] = []  # oids the storage served
        self._pending: dict[str, tuple[int, str]] = {}  # oid -> (size, one-time upload token) issued by a batch
        self._lock = threading.Lock()
        hub = self

        def _not_implemented(handler):
            path = unquote(urlparse(handler.path).path)
            handler.close_connection = True  # the request body may not have been read
            hub.unknown.append(f"{handler.command} {path}")
            return handler._json(404, {"error": f"not implemented: {handler.command} {path}"})

        class Storage(_Handler):
            """Stands in for the object store behind the Hub's LFS (S3 / CDN): another origin than the Hub."""

            def do_PUT(self):
                parts = self._path().split("/")
                if len(parts) != 3 or parts[1] != "upload":
                    return _not_implemented(self)
                oid, token = parts[2], self._query().get("token", [""])[0]
                data = self._body()
                with hub._lock:
                    pending = hub._pending.get(oid)
                    if pending is None or not secrets.compare_digest(pending[1], token):
                        return self._json(403, {"error": "no upload was authorised for this object"})
                    if len(data) != pending[0] or hashlib.sha256(data).hexdigest() != oid:
                        return self._json(400, {"error": "content does not match the announced oid and size"})
                    del hub._pending[oid]
                    hub.lfs_objects[oid] = data
                    hub.lfs_uploads.append({"oid": oid, "size": len(data)})
                return self._send(200, b"", {"ETag": f'"{hashlib.md5(data).hexdigest()}"'})

            def _object(self):
                parts = self._path().split("/")
                if len(parts) != 3 or parts[1] != "lfs":
                    return _not_implemented(self)
                data = hub.lfs_objects.get(parts[2])
                if data is None:
                    return self._json(404, {"error": "no such object"})
                headers, code = {"ETag": f'"{parts[2]}"', "Accept-Ranges": "bytes"}, 200
                spec = self.headers.get("Range")
                if spec:  # "bytes=start-" or "bytes=start-end" (the client resumes interrupted downloads)
                    start, _, end = spec.removeprefix("bytes=").partition("-")
                    start, end = int(start), int(end) if end else len(data) - 1
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                    data, code = data[start : end + 1], 206
                if self.command == "GET":
                    hub.lfs_downloads.append(parts[2])
                return self._send(code, data, headers, content_type="application/octet-stream")

            do_GET = do_HEAD = _object

            def do_POST(self):
                return _not_implemented(self)

        class Hub(_Handler):
            # Dataset repos are addressed under /datasets/... and /api/datasets/...; the handler maps those URLs onto
            # the model ones and keeps dataset repos under a "datasets/" key, so a dataset never shadows a model.
            kind = ""

            def _path(self):
                path = super()._path()
                for prefix, replacement in (("/api/datasets/", "/api/models/"), ("/datasets/", "/")):
                    if path.startswith(prefix):
                        self.kind = "datasets/"
                        return replacement + path[len(prefix) :]
                self.kind = ""
                return path

            def _repo(self, repo_id):
                return hub.repos.get(self.kind + repo_id)

            def do_PUT(self):
                return _not_implemented(self)

            def do_POST(self):
                path = self._path()
                body = self._body()
                if path == "/api/validate-yaml":  # the client validates README.md metadata before committing
                    content = json.loads(body or b"{}").get("content", "")
                    hub.validated.append(content)
                    return self._json(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    req = json.loads(body or b"{}")
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    kind = "datasets/" if req.get("type") == "dataset" else ""
                    if kind + repo_id in hub.repos:
                        what = "dataset" if kind else "model"
                        return self._json(409, {"error": f"You already created this {what} repo", "url": repo_id})
                    private = req.get("visibility", "private" if req.get("private") else "public") == "private"
                    repo = {"private": private, "revisions": {"main": {}}, "pointers": {"main": {}}}
                    hub.repos[kind + repo_id] = repo
                    return self._json(200, {"url": f"{hub.endpoint}/{kind}{repo_id}", "name": repo_id})
                parts = path.split("/")
                # /{org}/{name}.git/info/lfs/objects/{batch,verify}
                if len(parts) == 7 and parts[2].endswith(".git") and parts[3:6] == ["info", "lfs", "objects"]:
                    repo_id = f"{parts[1]}/{parts[2].removesuffix('.git')}"
                    if self._repo(repo_id) is None:
                        return self._json(404, {"message": "Repository not found"}, content_type=LFS_CONTENT_TYPE)
                    if parts[6] == "batch":
                        return self._lfs_batch(repo_id, json.loads(body))
                    if parts[6] == "verify":
                        req = json.loads(body)
                        data = hub.lfs_objects.get(req.get("oid"))
                        if data is None or len(data) != req.get("size"):
                            return self._json(404, {"message": "object not found"}, content_type=LFS_CONTENT_TYPE)
                        hub.lfs_verified.append(req["oid"])
                        return self._json(200, {}, content_type=LFS_CONTENT_TYPE)
                # /api/models/{org}/{name}/{action}/{revision}
                if len(parts) >= 6 and parts[1] == "api" and parts[2] == "models":
                    repo_id, action, rev = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:]) or "main"
                    repo = self._repo(repo_id)
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    if self._query():  # create_pr, hot_reload, ...: pull requests are not implemented
                        return _not_implemented(self)
                    if action == "preupload":
                        req = json.loads(body)
                        if "gitIgnore" in req:  # .gitignore matching is not implemented
                            return _not_implemented(self)
                        out = []
                        for f in req["files"]:
                            sample = base64.b64decode(f.get("sample", ""))
                            mode = "lfs" if should_be_lfs(f["path"], f["size"], sample) else "regular"
                            hub.preuploads[f["path"]] = mode
                            out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False})
                        return self._json(200, {"files": out})
                    if action == "branch":
                        repo["revisions"].setdefault(rev, dict(repo["revisions"]["main"]))
                        repo["pointers"].setdefault(rev, dict(repo["pointers"]["main"]))
                        return self._json(200, {})
                    if action == "commit":
                        return self._commit(repo_id, repo, rev, body)
                return _not_implemented(self)

            def _lfs_batch(self, repo_id, req):
                if req.get("operation") != "upload" or "basic" not in req.get("transfers", ["basic"]):
                    return _not_implemented(self)
                if req.get("hash_algo", "sha256") != "sha256":
                    return _not_implemented(self)
                objects = []
                with hub._lock:
                    for obj in req["objects"]:
                        oid, size = obj["oid"], obj["size"]
                        if oid in hub.lfs_objects:  # already stored: no actions, the client skips the upload
                            objects.append({"oid": oid, "size": size})
                            continue
                        token = secrets.token_hex(16)
                        hub._pending[oid] = (size, token)
                        objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                            "upload": {"href": f"{hub.storage_endpoint}/upload/{oid}?token={token}", "expires_in": 900},
                            "verify": {"href": f"{hub.endpoint}/{self.kind}{repo_id}.git/info/lfs/objects/verify"},
                        }})  # fmt: skip
                    hub.lfs_batches.append({"repo": self.kind + repo_id, "oids": [o["oid"] for o in req["objects"]]})
                return self._json(200, {"transfer": "basic", "objects": objects}, content_type=LFS_CONTENT_TYPE)

            def _commit(self, repo_id, repo, rev, body):
                items = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                summary, regular, lfs, deleted = None, {}, {}, []
                for item in items:
                    key, value = item["key"], item["value"]
                    if key == "header":
                        summary = value.get("summary")
                    elif key == "file":
                        data = base64.b64decode(value["content"])
                        if should_be_lfs(value["path"], len(data), data[:512]):
                            return self._json(400, {"error": f"Your push was rejected because it contains binary "
                                                    f"files: {value['path']} must be stored with LFS"})  # fmt: skip
                        regular[value["path"]] = data
                    elif key == "lfsFile":
                        data = hub.lfs_objects.get(value["oid"])
                        if value.get("algo", "sha256") != "sha256" or data is None or len(data) != value["size"]:
                            return self._json(422, {"error": f"LFS pointer for {value['path']} names an object that "
                                                    "was not uploaded"})  # fmt: skip
                        lfs[value["path"]] = value["oid"]
                    elif key == "deletedFile":
                        deleted.append(value["path"])
                    else:
                        return _not_implemented(self)  # deletedFolder, copies of LFS files, ...
                files = repo["revisions"].setdefault(rev, {})
                pointers = repo["pointers"].setdefault(rev, {})
                for name in deleted:
                    files.pop(name, None)
                    pointers.pop(name, None)
                for name, data in regular.items():
                    files[name] = data
                    pointers.pop(name, None)
                for name, oid in lfs.items():
                    files[name] = hub.lfs_objects[oid]
                    pointers[name] = oid
                oid = _revision_sha(files)
                hub.commits.append({"repo": self.kind + repo_id, "revision": rev, "summary": summary, "oid": oid,
                                    "regular": sorted(regular), "lfs": sorted(lfs)})  # fmt: skip
                return self._json(200, {"commitUrl": f"{hub.endpoint}/{self.kind}{repo_id}/commit/{oid}",
                                        "commitOid": oid, "pullRequestUrl": None})  # fmt: skip

            def _resolve(self):
                parts = self._path().split("/")
                # /{org}/{name}/resolve/{revision}/{file...}
                if len(parts) >= 6 and parts[3] == "resolve":
                    repo = self._repo(f"{parts[1]}/{parts[2]}")
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    rev, name = _find_revision(repo, parts[4]), "/".join(parts[5:])
                    if rev is None:
                        return self._json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    files = repo["revisions"][rev]
                    commit = _revision_sha(files)
                    if name not in files:
                        return self._json(404, {"error": "Entry not found"},
                                          {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})  # fmt: skip
                    data, oid = files[name], repo["pointers"][rev].get(name)
                    if oid is not None:  # LFS: redirect to the storage, file metadata on the redirect itself
                        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_oid(lfs_pointer(oid, len(data)))}"',
                                   "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": str(len(data)),
                                   "Location": f"{hub.storage_endpoint}/lfs/{oid}"}  # fmt: skip
                        return self._send(302, b"", headers)
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_oid(data)}"'}
                    return self._send(200, data, headers, content_type="application/octet-stream")
                return _not_implemented(self)

            def _tree(self, repo_id, revision, folder):
                """list_repo_tree: /api/models/{org}/{name}/tree/{revision}[/{folder}]?recursive=..., one page."""
                repo = self._repo(repo_id)
                rev = _find_revision(repo, revision) if repo is not None else None
                if rev is None:
                    return self._json(404, {"error": "Repository or revision not found"})
                recursive = self._query().get("recursive", ["false"])[0].lower() == "true"
                prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
                entries = {}
                for name, data in sorted(repo["revisions"][rev].items()):
                    if not name.startswith(prefix):
                        continue
                    rest = name[len(prefix) :].split("/")
                    depth = len(rest) if recursive else 1
                    for k in range(1, min(depth, len(rest) - 1) + 1):  # the folders on the way
                        sub = prefix + "/".join(rest[:k])
                        entries[sub] = {"type": "directory", "oid": hashlib.sha1(sub.encode()).hexdigest(), "size": 0,
                                        "path": sub}  # fmt: skip
                    if recursive or len(rest) == 1:
                        entries[name] = {"type": "file", "oid": git_blob_oid(data), "size": len(data), "path": name}
                        oid = repo["pointers"][rev].get(name)
                        if oid is not None:
                            entries[name]["lfs"] = {"oid": oid, "size": len(data), "pointerSize": 134}
                if prefix and not entries:
                    return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                return self._json(200, list(entries.values()))

            def do_HEAD(self):
                return self._resolve()

            def do_GET(self):
                path = self._path()
                if path == "/api/agent-harnesses":  # client-side agent detection; nothing here
                    return self._json(200, {"standardEnvVars": [], "harnesses": []})
                parts = path.split("/")
                if len(parts) >= 7 and parts[1] == "api" and parts[2] == "models" and parts[5] == "tree":
                    return self._tree(f"{parts[3]}/{parts[4]}", parts[6], "/".join(parts[7:]))
                # model_info: /api/models/{org}/{name} or /api/models/{org}/{name}/revision/{rev}
                if len(parts) >= 5 and parts[1] == "api" and parts[2] == "models":
                    if not (len(parts) == 5 or (len(parts) == 7 and parts[5] == "revision")):
                        return _not_implemented(self)
                    repo = self._repo(f"{parts[3]}/{parts[4]}")
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    rev = _find_revision(repo, parts[6] if len(parts) == 7 else "main")
                    if rev is None:
                        return self._json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    files = repo["revisions"][rev]
                    sha = _revision_sha(files)
                    return self._json(200, {"id": f"{parts[3]}/{parts[4]}", "modelId": f"{parts[3]}/{parts[4]}",
                                            "sha": sha, "private": repo["private"], "tags": [],
                                            "siblings": [{"rfilename": name} for name in sorted(files)]})  # fmt: skip
                return self._resolve()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
        self.storage = ThreadingHTTPServer(("127.0.0.1", 0), Storage)
        self.server.daemon_threads = self.storage.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.storage_endpoint = f"http://127.0.0.1:{self.storage.server_address[1]}"
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.server, self.storage)]

    def lfs_paths(self, repo_id: str, revision: str = "main") -> dict[str, str]:
        """Files of a revision stored as LFS pointers: path -> sha256 oid."""
        return dict(self.repos[repo_id]["pointers"][revision])

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        for server in (self.server, self.storage):
            server.shutdown()
            server.server_close()
        for thread in self.threads:
            thread.join(timeout=5)


def point_client_at(server: LocalHub, monkeypatch, tmp_path) -> None:
    """Points huggingface_hub at ``server`` for one test, with a cache of its own under ``tmp_path``.

    The local hub speaks the LFS batch protocol, not Xet: without ``HF_HUB_DISABLE_XET`` an installed hf_xet would
    ask for a Xet token, an endpoint the local hub does not implement.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))

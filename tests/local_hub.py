"""A minimal Hub-compatible HTTP endpoint for offline publishing tests.

It implements the part of the Hub API that huggingface_hub's client uses to create a repository, upload files as
regular (non-LFS) blobs through the preupload + commit endpoints, create branches, and serve files back through
``/{repo}/resolve/{revision}/{path}``. Files are kept in memory per repository and revision.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def _revision_sha(files: dict) -> str:
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
    return digest.hexdigest()


def _find_revision(repo: dict, rev: str) -> dict | None:
    """Files of a branch name or of a commit sha (the client resolves files by the sha it was given)."""
    if rev in repo["revisions"]:
        return repo["revisions"][rev]
    for files in repo["revisions"].values():
        if _revision_sha(files) == rev:
            return files
    return None


class LocalHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "revisions": {rev: {path: bytes}}}
        self.commits: list[dict] = []
        self.unknown: list[str] = []
        self.validated: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
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

            def _json(self, code, obj, headers=None):
                self._send(code, json.dumps(obj).encode(), headers)

            def _body(self):
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                body = self._body()
                if path == "/api/validate-yaml":  # the client validates README.md metadata before committing
                    content = json.loads(body or b"{}").get("content", "")
                    hub.validated.append(content)
                    return self._json(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    req = json.loads(body or b"{}")
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    if repo_id in hub.repos:
                        return self._json(409, {"error": "You already created this model repo", "url": repo_id})
                    private = req.get("visibility", "private" if req.get("private") else "public") == "private"
                    hub.repos[repo_id] = {"private": private, "revisions": {"main": {}}}
                    return self._json(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})
                parts = path.split("/")
                # /api/models/{org}/{name}/{action}/{revision}
                if len(parts) >= 6 and parts[1] == "api" and parts[2] == "models":
                    repo_id, action, rev = f"{parts[3]}/{parts[4]}", parts[5], "/".join(parts[6:]) or "main"
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        out = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                        return self._json(200, {"files": out})
                    if action == "branch":
                        repo["revisions"].setdefault(rev, dict(repo["revisions"]["main"]))
                        return self._json(200, {})
                    if action == "commit":
                        files = repo["revisions"].setdefault(rev, {})
                        summary = None
                        for line in body.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "header":
                                summary = item["value"].get("summary")
                            elif item["key"] == "file":
                                value = item["value"]
                                files[value["path"]] = base64.b64decode(value["content"])
                            elif item["key"] == "deletedFile":
                                files.pop(item["value"]["path"], None)
                            else:
                                hub.unknown.append(f"commit item {item['key']}")
                        oid = _revision_sha(files)
                        hub.commits.append({"repo": repo_id, "revision": rev, "summary": summary, "oid": oid})
                        return self._json(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}",
                                                "commitOid": oid, "pullRequestUrl": None})  # fmt: skip
                hub.unknown.append(f"POST {path}")
                return self._json(404, {"error": f"not implemented: POST {path}"})

            def _resolve(self):
                path = unquote(urlparse(self.path).path)
                parts = path.split("/")
                # /{org}/{name}/resolve/{revision}/{file...}
                if len(parts) >= 6 and parts[3] == "resolve":
                    repo = hub.repos.get(f"{parts[1]}/{parts[2]}")
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    rev, name = parts[4], "/".join(parts[5:])
                    files = _find_revision(repo, rev)
                    if files is None:
                        return self._json(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    if name not in files:
                        return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    data = files[name]
                    commit = _revision_sha(files)
                    etag = hashlib.sha256(data).hexdigest()
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
                    return self._send(200, data, headers, content_type="application/octet-stream")
                hub.unknown.append(f"{self.command} {path}")
                return self._json(404, {"error": f"not implemented: {self.command} {path}"})

            def do_HEAD(self):
                return self._resolve()

            def do_GET(self):
                if urlparse(self.path).path == "/api/agent-harnesses":  # client-side agent detection; nothing here
                    return self._json(200, {"standardEnvVars": [], "harnesses": []})
                parts = unquote(urlparse(self.path).path).split("/")
                if len(parts) >= 5 and parts[1] == "api" and parts[2] == "models":  # model_info
                    repo = hub.repos.get(f"{parts[3]}/{parts[4]}")
                    if repo is None:
                        return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    rev = parts[6] if len(parts) >= 7 and parts[5] == "revision" else "main"
                    files = _find_revision(repo, rev) or {}
                    sha = _revision_sha(files)
                    return self._json(200, {"id": f"{parts[3]}/{parts[4]}", "modelId": f"{parts[3]}/{parts[4]}",
                                            "sha": sha, "private": repo["private"], "tags": [],
                                            "siblings": [{"rfilename": name} for name in sorted(files)]})  # fmt: skip
                return self._resolve()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

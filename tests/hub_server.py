"""A minimal Hugging Face Hub for tests: the HTTP API that huggingface_hub's upload and download use.

Serves, on 127.0.0.1, what ``HfApi.create_repo``/``create_branch``/``upload_folder`` (regular,
non-LFS uploads; create_pr through a pull request ref), ``repo_info`` and ``hf_hub_download``
need. Repos live in memory as git-like commits of whole file trees. With ``require_token`` every
request needs ``Authorization: Bearer <token>``, as on the real Hub for writes.
"""
import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import ModelCard

USER = 'test-user'
_REPO = r'(?P<repo>[\w.-]+/[\w.-]+)'
_REV = r'(?P<rev>[^/]+)'


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a blob, the oid the Hub reports for regular files."""
    return hashlib.sha1(b'blob %d\0' % len(content) + content).hexdigest()


@dataclass
class Commit:
    oid: str
    files: dict[str, bytes]
    message: str


@dataclass
class Repo:
    private: bool
    refs: dict[str, Commit] = field(default_factory=dict)  # branch or refs/pr/N -> head
    commits: list[Commit] = field(default_factory=list)
    pull_requests: list[str] = field(default_factory=list)  # titles, PR n is at n - 1

    def commit(self, ref: str, files: dict[str, bytes], message: str) -> Commit:
        oid = hashlib.sha1(f'{len(self.commits)}:{ref}:{message}'.encode()).hexdigest()
        new = Commit(oid, files, message)
        self.commits.append(new)
        self.refs[ref] = new
        return new

    def resolve(self, rev: str) -> Commit | None:
        return self.refs.get(rev) or next((c for c in self.commits if c.oid == rev), None)


class HubServer(ThreadingHTTPServer):
    """The Hub; ``url`` is its endpoint, ``requests`` lists ``(method, path)`` as they came."""
    daemon_threads = True

    def __init__(self, require_token: str | None = None):
        super().__init__(('127.0.0.1', 0), _Handler)
        self.require_token = require_token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.url = f'http://127.0.0.1:{self.server_address[1]}'
        self._thread = threading.Thread(target=self.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)

    def __enter__(self) -> 'HubServer':
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    server: HubServer

    def log_message(self, format, *args) -> None:  # keep test output quiet
        pass

    # ---------------------------------------------------------------- plumbing

    def _send(self, status: int, body: bytes | dict | None = None, headers: dict | None = None,
              head: bool = False) -> None:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        body = body or b''
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, message: str, code: str | None = None, head: bool = False, **headers) -> None:
        headers['X-Error-Message'] = message
        if code:
            headers['X-Error-Code'] = code
        self._send(status, {'error': message}, {'Content-Type': 'application/json', **headers}, head=head)

    def _route(self, method: str) -> None:
        self.body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
        split = urlsplit(self.path)
        path, query = unquote(split.path), parse_qs(split.query)
        with self.server.lock:
            self.server.requests.append((method, path))
        token = self.server.require_token
        if token and self.headers.get('authorization') != f'Bearer {token}':
            return self._error(401, 'Invalid username or password.', head=method == 'HEAD')
        for pattern, name in _ROUTES[method]:
            if m := re.fullmatch(pattern, split.path):
                groups = {k: unquote(v) for k, v in m.groupdict().items()}
                with self.server.lock:
                    return getattr(self, name)(query=query, **groups)
        self._error(404, f'no route for {method} {path}', head=method == 'HEAD')

    def do_GET(self) -> None:
        self._route('GET')

    def do_HEAD(self) -> None:
        self._route('HEAD')

    def do_POST(self) -> None:
        self._route('POST')

    def _repo(self, repo: str) -> Repo | None:
        found = self.server.repos.get(repo)
        if found is None:
            self._error(404, 'Repository not found', 'RepoNotFound')
        return found

    # ---------------------------------------------------------------- API

    def create_repo(self, query) -> None:
        payload = json.loads(self.body)
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        url = f'{self.server.url}/{repo_id}'
        if repo_id in self.server.repos:  # the Hub names the repo in a 409 too (create_repo(exist_ok=True) reads it)
            return self._send(409, {'error': 'You already created this model repo', 'url': url})
        repo = self.server.repos[repo_id] = Repo(private=payload.get('visibility') == 'private')
        repo.commit('main', {'.gitattributes': b'*.safetensors filter=lfs diff=lfs merge=lfs -text\n'}, 'initial')
        self._send(200, {'url': url, 'name': repo_id})

    def validate_yaml(self, query) -> None:
        try:
            ModelCard(json.loads(self.body)['content'], ignore_metadata_errors=False)
        except ValueError as e:
            return self._send(400, {'errors': [{'message': str(e)}]})
        self._send(200, {'errors': [], 'warnings': []})

    def repo_info(self, query, repo: str, rev: str = 'main') -> None:
        if (found := self._repo(repo)) is None:
            return
        if (commit := found.resolve(rev)) is None:
            return self._error(404, 'Invalid rev id', 'RevisionNotFound')
        self._send(200, {
            'id': repo, 'sha': commit.oid, 'private': found.private,
            'siblings': [{'rfilename': name} for name in sorted(commit.files)],
        })

    def create_branch(self, query, repo: str, rev: str) -> None:
        if (found := self._repo(repo)) is None:
            return
        start = json.loads(self.body or b'{}').get('startingPoint', 'main')
        if rev in found.refs:
            return self._error(409, 'Reference already exists')
        found.refs[rev] = found.resolve(start)
        self._send(200, {})

    def create_discussion(self, query, repo: str) -> None:
        if (found := self._repo(repo)) is None:
            return
        payload = json.loads(self.body)
        found.pull_requests.append(payload['title'])
        num = len(found.pull_requests)
        found.refs[f'refs/pr/{num}'] = found.refs['main']
        self._send(200, {'num': num, 'url': f'{self.server.url}/{repo}/discussions/{num}'})

    def discussion(self, query, repo: str, num: str) -> None:
        if (found := self._repo(repo)) is None:
            return
        self._send(200, {
            'title': found.pull_requests[int(num) - 1], 'num': int(num), 'author': {'name': USER},
            'createdAt': datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.%fZ'), 'status': 'draft',
            'repo': {'name': repo, 'type': 'model'}, 'isPullRequest': True, 'events': [],
            'changes': {'base': 'refs/heads/main'}, 'filesWithConflicts': [],
        })

    def preupload(self, query, repo: str, rev: str) -> None:
        if (found := self._repo(repo)) is None:
            return
        payload = json.loads(self.body)
        if (head := found.resolve(rev)) is None:
            return self._error(404, 'Invalid rev id', 'RevisionNotFound')
        files = [{
            'path': f['path'],
            'uploadMode': 'regular',  # no LFS/Xet: the client then sends contents inline with the commit
            'shouldIgnore': False,
            'oid': git_blob_sha1(head.files[f['path']]) if f['path'] in head.files else None,
        } for f in payload['files']]
        self._send(200, {'files': files, 'commitOid': head.oid})

    def commit(self, query, repo: str, rev: str) -> None:
        if (found := self._repo(repo)) is None:
            return
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if (head := found.resolve(rev)) is None:
            return self._error(404, 'Invalid rev id', 'RevisionNotFound')
        files = dict(head.files)
        for line in lines[1:]:
            value = line['value']
            if line['key'] != 'file':
                return self._error(400, f"unsupported commit operation {line['key']}")
            files[value['path']] = base64.b64decode(value['content'])
        new = found.commit(rev, files, lines[0]['value']['summary'])
        self._send(200, {'commitUrl': f'{self.server.url}/{repo}/commit/{new.oid}', 'commitOid': new.oid,
                         'pullRequestUrl': None})

    def resolve(self, query, repo: str, rev: str, filename: str, head: bool = False) -> None:
        found = self.server.repos.get(repo)
        if found is None:
            return self._error(404, 'Repository not found', 'RepoNotFound', head=head)
        if (commit := found.resolve(rev)) is None:
            return self._error(404, 'Invalid rev id', 'RevisionNotFound', head=head)
        if filename not in commit.files:
            return self._error(404, 'Entry not found', 'EntryNotFound', head=head, **{'X-Repo-Commit': commit.oid})
        content = commit.files[filename]
        self._send(200, content, {
            'Content-Type': 'application/octet-stream',
            'X-Repo-Commit': commit.oid,
            'ETag': f'"{git_blob_sha1(content)}"',
        }, head=head)

    def resolve_head(self, query, **kwargs) -> None:
        self.resolve(query, head=True, **kwargs)


_API = r'/api/models/' + _REPO
_ROUTES = {
    'GET': [
        (_API, 'repo_info'),
        (_API + r'/revision/' + _REV, 'repo_info'),
        (_API + r'/discussions/(?P<num>\d+)', 'discussion'),
        (r'/' + _REPO + r'/resolve/' + _REV + r'/(?P<filename>.+)', 'resolve'),
    ],
    'HEAD': [
        (r'/' + _REPO + r'/resolve/' + _REV + r'/(?P<filename>.+)', 'resolve_head'),
    ],
    'POST': [
        (r'/api/repos/create', 'create_repo'),
        (r'/api/validate-yaml', 'validate_yaml'),
        (_API + r'/branch/' + _REV, 'create_branch'),
        (_API + r'/discussions', 'create_discussion'),
        (_API + r'/preupload/' + _REV, 'preupload'),
        (_API + r'/commit/' + _REV, 'commit'),
    ],
}

"""`regenerate --endpoint` against small misbehaving servers (real HTTP servers on 127.0.0.1,
answering from a script): a server whose /v1/models fails, one that answers with empty content,
one that ignores max_tokens. Each is one line naming what is wrong, or a failed row, never a
traceback or a garbage row."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from dflash_train.cli import main

MAX_TOKENS = 16


class ScriptedServer(http.server.ThreadingHTTPServer):
    """/v1/models answers `models` (a status and body); /v1/chat/completions answers `content`
    with `completion_tokens` tokens."""

    daemon_threads = True

    def __init__(self, models=(200, {"data": [{"id": "served"}]}), content="an answer", completion_tokens=3):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.models, self.content, self.completion_tokens = models, content, completion_tokens
        self.chats = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, payload) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.endswith("/models"):
            return self._send(*self.server.models)
        self._send(404, {"error": "no such route"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self.path.endswith("/chat/completions"):
            return self._send(404, {"error": "no such route"})
        self.server.chats += 1
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": self.server.content},
                                      "finish_reason": "stop"}],
                         "usage": {"completion_tokens": self.server.completion_tokens}})


@pytest.fixture
def scripted():
    servers = []

    def start(**kw):
        servers.append(ScriptedServer(**kw))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _prompts(tmp_path, count=4):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i}."}) + "\n" for i in range(count)))
    return path


def _regenerate(server, tmp_path, *extra):
    return main(["regenerate", "--endpoint", server.url, "--prompts", str(_prompts(tmp_path)), "--out",
                 str(tmp_path / "rows.jsonl"), "--max-new-tokens", str(MAX_TOKENS), "--retries", "0", *extra])


def _errors(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("regenerate [")]


@pytest.mark.parametrize("models", [(500, {"error": "boom"}), (404, {"error": "no such route"}),
                                    (200, b"<html>not json</html>"), (200, {"object": "list"})],
                         ids=["500", "404", "html", "no-list"])
def test_a_failing_model_list_is_one_line_and_model_skips_it(scripted, tmp_path, capsys, models):
    server = scripted(models=models)
    assert _regenerate(server, tmp_path) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and f"{server.url}/models" in errors[0] and "Traceback" not in errors[0], errors
    assert not (tmp_path / "rows.jsonl").exists()
    # --model names the served model: /v1/models is not needed at all (D9: a proxy without the route)
    assert _regenerate(server, tmp_path, "--model", "served") == 0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and server.chats == 4


def test_empty_answers_are_failed_rows_not_data(scripted, tmp_path, capsys):
    server = scripted(content="")
    assert _regenerate(server, tmp_path) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "answered none of the requests" in errors[0] and "empty content" in errors[0], errors
    out = tmp_path / "rows.jsonl"
    assert not out.exists() or out.read_text() == ""


@pytest.mark.parametrize("content,tokens,match", [
    ("word " * 200_000, 7, "characters, more than 16 tokens"),  # a 1 MB body whose usage says 7 tokens
    ("a short answer", MAX_TOKENS + 30, "46 tokens where max_tokens is 16"),
], ids=["huge-body", "usage-above-max"])
def test_answers_beyond_max_tokens_are_refused(scripted, tmp_path, capsys, content, tokens, match):
    server = scripted(content=content, completion_tokens=tokens)
    assert _regenerate(server, tmp_path) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and match in errors[0], errors
    out = tmp_path / "rows.jsonl"
    assert not out.exists() or out.read_text() == ""

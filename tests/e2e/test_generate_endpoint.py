"""`regenerate --endpoint`: a real OpenAI-compatible server (`transformers serve` running SmolLM2 on
this CPU), started by the tests, answers the prompts. Faults (HTTP 503 / 429 / 500 / 400, a server
that stops answering) come from a small HTTP proxy in front of that real server, which forwards
every other request untouched."""

import http.server
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.generate.endpoint import EndpointError, RowError, answer_from_response, api_base

SERVE_MODULES = ("fastapi", "uvicorn", "openai")
MAX_NEW_TOKENS = "6"
PROMPTS = [
    {"id": "capital", "prompt": "What is the capital of France?"},
    {"id": "yes", "prompt": "Reply with the single word yes."},
    {"id": "haiku", "prompt": "Write a haiku about rain."},
    {"id": "colour", "prompt": "Name a colour."},
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    """`transformers serve` pinned to the SmolLM2 folder, float32 on the CPU; its URL."""
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"`transformers serve` needs {', '.join(missing)}: pip install -e '.[test]'")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(smollm2_dir), "--device", "cpu",
               "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"transformers serve did not come up:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class FaultProxy(http.server.ThreadingHTTPServer):
    """Forwards to `upstream`, except where `policy(path, body, attempt)` says otherwise: an int is
    an HTTP status to answer with, "drop" closes the connection without an answer (a dead server).
    `attempt` counts the requests with this path and body so far (0 = first)."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream
        self.policy = lambda path, body, attempt: None
        self.seen: dict[tuple[str, bytes], int] = {}
        self.forwarded_chats = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        proxy = self.server
        with proxy.lock:
            attempt = proxy.seen.get((self.path, body), 0)
            proxy.seen[self.path, body] = attempt + 1
            decision = proxy.policy(self.path, body, attempt)
            if decision is None and self.path.endswith("/chat/completions"):
                proxy.forwarded_chats += 1
        if decision == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if isinstance(decision, int):
            payload = json.dumps({"error": {"message": f"injected HTTP {decision}"}}).encode()
            self.send_response(decision)
            if decision == 429:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        request = urllib.request.Request(proxy.upstream + self.path, data=body or None, method=self.command,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, payload = error.code, error.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _handle


@pytest.fixture
def proxy(server):
    proxy = FaultProxy(server)
    yield proxy
    proxy.close()


def prompt_file(tmp_path, rows=PROMPTS, name="prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_rows(path: Path) -> dict:
    return {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}


def regenerate(url, prompts, out, *extra):
    return main(["regenerate", "--endpoint", url, "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", MAX_NEW_TOKENS, *extra])


def error_lines(capsys):
    """What the run printed on stderr, less its progress lines."""
    return [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("regenerate [")]


def is_chat(path):
    return path.endswith("/chat/completions")


def test_endpoint_rows_match_the_local_path(server, smollm2_dir, tmp_path, capsys, one_thread):
    """Greedy answers through the server are the rows the local path writes, token counts included;
    --target only supplies the tokenizer for the prompt-length cap."""
    long_prompt = {"id": "long", "prompt": "Please summarise this. " + "The quick brown fox jumps over the lazy dog. " * 20}
    prompts = prompt_file(tmp_path, PROMPTS[:3] + [long_prompt])
    out = tmp_path / "endpoint.jsonl"
    assert regenerate(server, prompts, out, "--concurrency", "2", "--target", str(smollm2_dir),
                      "--max-prompt-tokens", "80") == 0
    printed = capsys.readouterr().out
    assert "input 4 = ok 3 + failed 0 + skipped 1" in printed and "prompt longer than 80 tokens" in printed
    local = tmp_path / "local.jsonl"
    assert main(["regenerate", "--target", str(smollm2_dir), "--prompts", str(prompts), "--out", str(local),
                 "--max-new-tokens", MAX_NEW_TOKENS, "--max-prompt-tokens", "80", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    served, expected = read_rows(out), read_rows(local)
    assert set(served) == set(expected) == {"capital", "yes", "haiku"}
    for row_id, row in expected.items():
        # the local rows also carry the generated token ids, which `transformers serve` does not return
        assert row["answer_token_ids"] and served[row_id] == {k: v for k, v in row.items()
                                                              if k not in ("answer_token_ids", "tokenizer_fingerprint")}, row_id
    assert {row["finish_reason"] for row in served.values()} <= {"stop", "length"}
    record = json.loads((tmp_path / "endpoint.jsonl.regenerate.json").read_text())
    assert record["endpoint"] == {"url": f"{server}/v1", "model": str(smollm2_dir)}
    assert record["settings"]["max_new_tokens"] == int(MAX_NEW_TOKENS)


def test_resume_sends_only_missing_rows_and_refuses_another_server_or_model(proxy, server, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert regenerate(proxy.url, prompt_file(tmp_path, PROMPTS[:2], "two.jsonl"), out) == 0
    assert proxy.forwarded_chats == 2
    assert regenerate(proxy.url, prompt_file(tmp_path, PROMPTS[:3], "three.jsonl"), out) == 0
    assert proxy.forwarded_chats == 3 and set(read_rows(out)) == {"capital", "yes", "haiku"}
    assert "resumed     2 rows were already in the output" in capsys.readouterr().out
    before = out.read_bytes()
    assert regenerate(server, prompt_file(tmp_path), out) == 2  # the same model, another URL
    assert "was written with other settings" in capsys.readouterr().err
    assert regenerate(proxy.url, prompt_file(tmp_path), out, "--model", "another-model") == 2
    assert "another-model" in capsys.readouterr().err
    assert proxy.forwarded_chats == 3 and out.read_bytes() == before
    # A model the server does not serve: it refuses every request, which is a setup error, not bad rows.
    assert regenerate(proxy.url, prompt_file(tmp_path, PROMPTS[:2]), tmp_path / "new.jsonl", "--model", "nope") == 2
    error = error_lines(capsys)
    assert len(error) == 1 and "answered none of the requests (last: HTTP 400" in error[0] and "nope" in error[0]


def test_503_and_429_are_retried(proxy, tmp_path, capsys):
    proxy.policy = lambda path, body, attempt: (503 if b"capital" in body else 429) if is_chat(path) and attempt == 0 else None
    out = tmp_path / "rows.jsonl"
    assert regenerate(proxy.url, prompt_file(tmp_path, PROMPTS[:2]), out, "--retries", "1") == 0
    assert set(read_rows(out)) == {"capital", "yes"} and proxy.forwarded_chats == 2
    assert "ok 2 + failed 0" in capsys.readouterr().out


def test_a_refused_row_is_counted_and_the_run_goes_on(proxy, tmp_path, capsys):
    proxy.policy = lambda path, body, attempt: 400 if is_chat(path) and b"haiku" in body else None
    out = tmp_path / "rows.jsonl"
    assert regenerate(proxy.url, prompt_file(tmp_path), out, "--concurrency", "2") == 0
    assert set(read_rows(out)) == {"capital", "yes", "colour"}
    printed = capsys.readouterr().out
    assert "input 4 = ok 3 + failed 1 + skipped 0" in printed and "generation failed: RowError" in printed
    assert "HTTP 400" in printed


def test_a_server_that_dies_mid_run_keeps_the_rows_and_a_rerun_resumes(proxy, tmp_path, capsys):
    answered = []

    def dies_after_two(path, body, attempt):
        if not is_chat(path):
            return None
        if len(answered) < 2 and attempt == 0:
            answered.append(body)
            return None
        return "drop"

    proxy.policy = dies_after_two
    out, prompts = tmp_path / "rows.jsonl", prompt_file(tmp_path)
    assert regenerate(proxy.url, prompts, out, "--concurrency", "1", "--retries", "1") == 2
    error = error_lines(capsys)
    assert len(error) == 1 and "Traceback" not in error[0]
    assert error[0].startswith(f"dflash-train regenerate: endpoint {proxy.url} is unreachable")
    assert "the 2 rows answered in this run are kept" in error[0]
    assert len(read_rows(out)) == 2 and out.read_bytes().endswith(b"\n")
    proxy.policy = lambda path, body, attempt: None  # the server is back
    assert regenerate(proxy.url, prompts, out, "--concurrency", "1") == 0
    assert set(read_rows(out)) == {row["id"] for row in PROMPTS} and len(out.read_text().splitlines()) == 4


def test_a_server_failing_every_request_stops_the_run(proxy, tmp_path, capsys):
    rows = [{"id": f"p{i}", "prompt": f"Count to {i}."} for i in range(12)]
    first = []
    proxy.policy = lambda path, body, attempt: None if not is_chat(path) or (first.append(1) or len(first) <= 1) else 500
    out = tmp_path / "rows.jsonl"
    assert regenerate(proxy.url, prompt_file(tmp_path, rows), out, "--concurrency", "1", "--retries", "0") == 2
    error = error_lines(capsys)
    assert len(error) == 1 and "failed 8 requests in a row (last: HTTP 500" in error[0]
    assert len(read_rows(out)) == 1


def test_an_unreachable_endpoint_fails_before_writing_anything(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert regenerate(url, prompt_file(tmp_path), out, "--retries", "0") == 2
    error = error_lines(capsys)
    assert len(error) == 1 and error[0].startswith(f"dflash-train regenerate: endpoint {url} is unreachable")
    assert not out.exists()


def test_endpoint_flags_are_checked_before_anything_runs(tmp_path, capsys):
    prompts = prompt_file(tmp_path)
    assert main(["regenerate", "--endpoint", "localhost:8000", "--prompts", str(prompts), "--out", "x.jsonl"]) == 2
    assert "expected an http(s) URL" in capsys.readouterr().err
    assert main(["regenerate", "--endpoint", "http://127.0.0.1:9/v1", "--prompts", str(prompts), "--out", "x.jsonl",
                 "--max-prompt-tokens", "100"]) == 2
    assert "needs --target" in capsys.readouterr().err
    assert main(["regenerate", "--target", "t", "--model", "m", "--prompts", str(prompts), "--out", "x.jsonl"]) == 2
    assert "use it with --endpoint" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions",
                                 "http://h:1/v1/models/"])
def test_api_base_accepts_what_users_paste(url):
    assert api_base(url) == "http://h:1/v1"


def test_answers_are_read_strictly():
    def response(content="hi", finish="stop", tokens=2, **message):
        return {"choices": [{"message": {"content": content, **message}, "finish_reason": finish}],
                "usage": {"completion_tokens": tokens}}

    assert answer_from_response(response(finish="eos")).finish_reason == "stop"
    assert answer_from_response(response(finish="length", tokens=6)).completion_tokens == 6
    for bad, match in [(response(finish="tool_calls"), "finish_reason"), (response(content=None), "no text"),
                       (response(reasoning_content="hmm"), "reasoning"), ({"choices": []}, "not a chat.completions"),
                       (response(tokens="2"), "token count")]:
        with pytest.raises(RowError, match=match):
            answer_from_response(bad)
    assert issubclass(EndpointError, Exception)


def test_a_server_that_refuses_the_token_id_fields_is_asked_without_them(proxy, server, smollm2_dir, tmp_path, capsys):
    """`transformers serve` returns no token ids and is not asked for them; a server that lists
    itself as vLLM is, and where it refuses the fields (the real `transformers serve` answers
    them with HTTP 422) the row is asked again without them, the run stops asking, and the rows
    are text only (training reads them so)."""
    out = tmp_path / "answers.jsonl"
    assert regenerate(server, prompt_file(tmp_path, PROMPTS[:2]), out, "--target", str(smollm2_dir)) == 0
    printed = capsys.readouterr().out
    assert "asking for the answers' token ids" not in printed and "refused" not in printed
    assert "token ids   0 of 2 rows carry their answer's generated token ids; 2 without: the engine returned no " \
           "token ids" in printed, printed

    original = proxy.RequestHandlerClass
    proxy.RequestHandlerClass = _ListsAsVllm
    try:
        out = tmp_path / "as-vllm.jsonl"
        assert regenerate(proxy.url, prompt_file(tmp_path, PROMPTS[:3], "three.jsonl"), out, "--target",
                          str(smollm2_dir), "--concurrency", "1") == 0
    finally:
        proxy.RequestHandlerClass = original
    printed = capsys.readouterr().out
    assert "asking for the answers' token ids (vllm)" in printed, printed
    assert "the server refused the token-id request fields (HTTP 422" in printed, printed
    assert proxy.forwarded_chats == 4  # the first row twice (with the fields, then without), then one each
    rows = read_rows(out)
    assert len(rows) == 3 and all("answer_token_ids" not in row and row["messages"][-1]["content"] for row in rows.values())


class _ListsAsVllm(_ProxyHandler):
    """The proxy's forwarding, with /v1/models answered as vLLM lists its models."""

    def do_GET(self):
        if self.path.endswith("/models"):
            upstream = json.loads(urllib.request.urlopen(self.server.upstream + "/v1/models", timeout=30).read())
            for entry in upstream["data"]:
                entry["owned_by"] = "vllm"
            payload = json.dumps(upstream).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        super().do_GET()

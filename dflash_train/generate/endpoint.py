"""An OpenAI-compatible chat server as the answer engine (`regenerate --endpoint URL`).

vLLM, SGLang, llama.cpp's server and `transformers serve` all answer `POST /v1/chat/completions`
with the chat's `messages` and `temperature`, `top_p`, `max_tokens`, `seed` (and, for thinking
templates, `chat_template_kwargs.enable_thinking`); the server applies the model's own chat
template, so the prompts are the ones a local run renders. Each row's answer is the response's
`message.content`, its `finish_reason` ("stop" or "length"; a server's "eos" counts as "stop")
and `usage.completion_tokens`. The row seed is sent reduced to 31 bits, which every server takes.
A server that splits the reasoning out of the content (a vLLM/SGLang reasoning parser) would lose
it from the row, so such a response fails the row: serve thinking models without one.

Token ids. Where the server is one that returns the generated token ids (told by the `owned_by`
of the model in its /v1/models list), each request asks for them, in that server's fields:
vLLM (`owned_by` "vllm"): `return_token_ids` (0.10.2 and later: `choices[0].token_ids`), and
`logprobs` with `return_tokens_as_token_ids` (earlier releases: each `logprobs.content[i].token`
reads "token_id:N"); llama.cpp's server ("llamacpp"): `logprobs` with `top_logprobs: 1`, whose
entries carry the token's `id`. SGLang's and `transformers serve`'s chat completions return no
ids, and other servers are not asked (`transformers serve` refuses unknown fields with HTTP 422).
A row refused with a 4xx while asking is asked once more without the fields; if that answers,
the run stops asking. `Answer.token_ids` is None where none came back; the driver keeps the ids
only where they decode to the text with the target's tokenizer (`--target`).
"""

from __future__ import annotations

import email.utils
import http.client
import json
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from ..data.readers import MAX_CHARS_PER_TOKEN
from ..errors import ConfigError, UserError
from .regenerate import Answer, Job

SEED_MASK = 0x7FFFFFFF
_FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}
# Request fields that make a server return the generated token ids, by its /v1/models `owned_by`.
TOKEN_ID_FIELDS: dict[str, dict[str, Any]] = {
    "vllm": {"return_token_ids": True, "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True},
    "llamacpp": {"logprobs": True, "top_logprobs": 1},
}
_TOKEN_ID_PREFIX = "token_id:"


# What the settings sidecar records for a sampled endpoint run: the server draws the samples.
SAMPLER = "server"


class EndpointError(UserError):
    """The server cannot be used: unreachable, or failing every request."""


class RowError(Exception):
    """The server answered this row with an error or with a response that cannot become a row."""


class _Transient(Exception):
    """A failure worth retrying (connection, timeout, 429, 5xx); `connection` when no HTTP answer came."""

    def __init__(self, message: str, *, connection: bool, retry_after: float | None = None):
        super().__init__(message)
        self.connection = connection
        self.retry_after = retry_after


def api_base(url: str) -> str:
    """`http://host:port/v1` from what a user may type: with or without /v1 or /v1/chat/completions."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--endpoint {url!r}: expected an http(s) URL such as http://localhost:8000/v1")
    path = parsed.path.rstrip("/")
    for suffix in ("/chat/completions", "/models"):
        path = path.removesuffix(suffix)
    if not path.endswith("/v1"):
        path += "/v1"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 5  # attempts after the first
    backoff_seconds: float = 1.0  # doubled after each failed attempt, with jitter
    max_backoff_seconds: float = 30.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        base = min(self.max_backoff_seconds, self.backoff_seconds * 2 ** attempt)
        if retry_after is not None:
            return min(self.max_backoff_seconds, max(base, retry_after))
        return base * (0.5 + random.random() / 2)


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time()) if when else None


class EndpointClient:
    """JSON over HTTP to one server, with the retry policy; thread-safe (one connection per request)."""

    def __init__(self, url: str, *, timeout: float = 600.0, retry: RetryPolicy = RetryPolicy(), api_key: str = ""):
        self.base = api_base(url)
        self.timeout = timeout
        self.retry = retry
        self.api_key = api_key

    def _once(self, path: str, body: dict | None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base + path, data=data, method="GET" if body is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", "replace").strip()
            message = f"HTTP {error.code} from {self.base}{path}" + (f": {detail}" if detail else "")
            if error.code == 429 or error.code >= 500:
                raise _Transient(message, connection=False, retry_after=_retry_after(error.headers)) from None
            raise RowError(message) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as error:
            reason = getattr(error, "reason", None) or error
            # A timeout may be one slow answer, not a dead server: it fails only its row (the
            # failure streak still ends a run against a server that never answers).
            slow = isinstance(reason, TimeoutError)
            what = f"no answer within {self.timeout:g} s" if slow else reason
            raise _Transient(f"{self.base}{path}: {what}", connection=not slow) from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise RowError(f"{self.base}{path} answered with something that is not JSON: {raw[:120]!r}") from None

    def request(self, path: str, body: dict | None = None, stop: threading.Event | None = None) -> Any:
        """The decoded JSON answer; retries transient failures, then raises the last one as
        EndpointError (no connection) or RowError (the server kept answering 429 / 5xx).
        Setting `stop` ends the retrying early."""
        stop = stop or threading.Event()
        for attempt in range(self.retry.retries + 1):
            try:
                return self._once(path, body)
            except _Transient as error:
                if attempt == self.retry.retries or stop.is_set():
                    tries = f"{attempt + 1} attempt" + ("s" if attempt else "")
                    if error.connection:
                        raise EndpointError(f"endpoint {self.base} is unreachable ({error}; {tries})") from None
                    raise RowError(f"{error} ({tries})") from None
                if stop.wait(self.retry.delay(attempt, error.retry_after)):
                    raise RowError(f"stopped while retrying: {error}") from None
        raise AssertionError("unreachable")

    def models(self) -> dict[str, str]:
        """Each listed model's id and its `owned_by` ("" where absent), in the server's order."""
        try:
            listing = self.request("/models")
        except RowError as error:  # a server still loading (5xx), one without the route (404), an HTML page
            raise EndpointError(f"{self.base}/models cannot list the served models ({error}); pass --model NAME "
                                "to name the model without asking") from None
        try:
            return {str(entry["id"]): str(entry.get("owned_by") or "") for entry in listing["data"]}
        except (KeyError, TypeError, AttributeError):
            raise EndpointError(f"{self.base}/models: not an OpenAI model list: {str(listing)[:200]}") from None

    def model_ids(self) -> list[str]:
        return list(self.models())


def resolve_model(client: EndpointClient, requested: str) -> tuple[str, str]:
    """`requested`, or the server's first listed model, and who serves it (`owned_by`: "vllm",
    "llamacpp", "sglang", ...; "" when not listed). A `requested` model needs no model list: a
    server or proxy without /v1/models still serves it (its kind is then unknown)."""
    if requested:
        try:
            return requested, client.models().get(requested, "")
        except EndpointError:
            return requested, ""
    models = client.models()
    if not models:
        raise EndpointError(f"{client.base}/models lists no model; pass --model NAME")
    model = next(iter(models))
    return model, models[model]


def answer_from_response(response: Any) -> Answer:
    """The row's answer from a chat.completions response (RowError if it is not a usable one)."""
    try:
        choice = response["choices"][0]
        message = choice["message"]
        text, finish, tokens = message.get("content"), choice.get("finish_reason"), response["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError):
        raise RowError(f"not a chat.completions response: {str(response)[:200]}") from None
    if message.get("reasoning_content") or message.get("reasoning"):
        raise RowError("the server split the reasoning out of the answer (a reasoning parser); serve the model without one")
    if not isinstance(text, str):
        raise RowError(f"no text in the response (content {text!r})")
    if finish not in _FINISH_REASONS:
        raise RowError(f"finish_reason {finish!r} is neither 'stop' nor 'length'")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise RowError(f"usage.completion_tokens {tokens!r} is not a token count")
    return Answer(text, _FINISH_REASONS[finish], tokens, token_ids_from_choice(choice))


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_ids_from_choice(choice: dict) -> list[int] | None:
    """The generated token ids a server put in a chat.completions choice, or None: vLLM's
    `token_ids`, else the logprobs entries' `id` (llama.cpp) or "token_id:N" tokens (vLLM with
    `return_tokens_as_token_ids`). Anything malformed counts as none: the row keeps its text."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(_is_id(i) for i in ids):
        return list(ids)
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not content:
        return None
    found = []
    for entry in content:
        if not isinstance(entry, dict):
            return None
        if _is_id(entry.get("id")):
            found.append(entry["id"])
            continue
        token = entry.get("token")
        if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX) and token[len(_TOKEN_ID_PREFIX):].isdigit():
            found.append(int(token[len(_TOKEN_ID_PREFIX):]))
            continue
        return None
    return found


def check_answer_bounds(answer: Answer, max_tokens: int) -> None:
    """Refuse (fail the row) what a server that ignores the request made of it: an empty answer,
    or one beyond max_tokens (by its usage, or by its length). An answer of only whitespace is kept:
    a target may really write a run of newlines, and its ids then say which tokens it wrote."""
    if not answer.text:
        raise RowError("the server answered with empty content")
    if answer.completion_tokens > max_tokens:
        raise RowError(f"the server answered {answer.completion_tokens} tokens where max_tokens is {max_tokens} "
                       "(it ignores max_tokens)")
    if len(answer.text) > MAX_CHARS_PER_TOKEN * max_tokens:
        raise RowError(f"the answer has {len(answer.text)} characters, more than {max_tokens} tokens (max_tokens) "
                       f"can be; usage says {answer.completion_tokens} tokens: the server ignores max_tokens")


class EndpointEngine:
    """Answers jobs through an OpenAI-compatible server, `concurrency` requests at a time."""

    def __init__(self, client: EndpointClient, model: str, *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, enable_thinking: bool | None = None, concurrency: int = 16,
                 failure_streak: int | None = None, server: str = ""):
        if concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {concurrency}")
        self.client = client
        self.model = model
        self.sampling = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        self.chat_template_kwargs = None if enable_thinking is None else {"enable_thinking": enable_thinking}
        self.concurrency = concurrency
        # Enough consecutive failures that a few bad prompts in flight together are not mistaken for a dead server.
        self.failure_streak = failure_streak or max(8, 2 * concurrency)
        self.token_id_fields = TOKEN_ID_FIELDS.get(server, {})
        asks = f", asking for the answers' token ids ({server})" if self.token_id_fields else ""
        self.description = f"endpoint {client.base}, model {model}, {concurrency} concurrent requests{asks}"
        self.setup_failures = None  # this engine gives up by its own rules (unreachable, a failure streak, no answer)
        self.ask_token_ids = bool(self.token_id_fields)  # until the server refuses the fields (see the module doc)
        self.refused_token_ids = ""

    def request_body(self, job: Job, token_ids: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in job.prompt.messages],
            **self.sampling,
            "seed": job.seed & SEED_MASK,
            "stream": False,
        }
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if token_ids:
            body.update(self.token_id_fields)
        return body

    def answer(self, job: Job, stop: threading.Event | None = None) -> Answer:
        if self.ask_token_ids:
            try:
                answer = answer_from_response(self.client.request("/chat/completions", self.request_body(job, True), stop))
            except RowError as error:
                if not re.match(r"HTTP 4(?!29)\d\d ", str(error)):
                    raise
                # The same request without the token-id fields: if the server answers it, it refused the fields.
                answer = answer_from_response(self.client.request("/chat/completions", self.request_body(job), stop))
                self.ask_token_ids = False
                self.refused_token_ids = str(error)
        else:
            answer = answer_from_response(self.client.request("/chat/completions", self.request_body(job), stop))
        check_answer_bounds(answer, self.sampling["max_tokens"])
        return answer

    def run_note(self) -> str:
        if self.refused_token_ids:
            return f"the server refused the token-id request fields ({self.refused_token_ids[:160]}); asked without them"
        return ""

    def answers(self, jobs: Iterable[Job]) -> Iterator[tuple[Job, Answer | BaseException]]:
        """(job, answer or the row's error) as requests finish, in any order; EndpointError ends it."""
        pending: dict[Future, Job] = {}
        queue = iter(jobs)
        streak = answered = 0
        last_error: BaseException | None = None
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="endpoint")
        try:
            while True:
                while len(pending) < self.concurrency and (job := next(queue, None)) is not None:
                    pending[pool.submit(self.answer, job, stop)] = job
                if not pending:
                    if answered == 0 and last_error is not None:
                        raise EndpointError(f"endpoint {self.client.base} answered none of the requests (last: {last_error})")
                    return
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    job = pending.pop(future)
                    error = future.exception()
                    if isinstance(error, EndpointError):
                        raise error
                    if error is None:
                        streak = 0
                        answered += 1
                        yield job, future.result()
                        continue
                    streak += 1
                    last_error = error
                    if streak >= self.failure_streak:
                        raise EndpointError(f"endpoint {self.client.base} failed {streak} requests in a row "
                                            f"(last: {error}); rows answered before are kept")
                    yield job, error
        finally:
            stop.set()  # requests still retrying give up at their next wait
            pool.shutdown(wait=False, cancel_futures=True)

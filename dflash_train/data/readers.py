"""Conversation and prompt files: read, validate every row, account for every skip.

Formats (chosen by file name):
    .jsonl / .jsonl.gz   one JSON object per line (blank lines ignored)
    .json / .json.gz     a JSON array of objects
    .parquet             one row per object (columns as below)
    .txt / .txt.gz       prompts only: one prompt per non-blank line

Row shapes:
    OpenAI    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
    ShareGPT  {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}
    prompt    {"prompt": str, "system": str (optional)}   (prompt files only)
An assistant message may carry `reasoning_content` (str), which templates such as Qwen3's use.
An optional `id` field (string or integer) names the row; otherwise its id is `file:line`.
A conversation row may carry the last answer's tokens as the target generated them (what
`regenerate` writes): `answer_token_ids` (array of token ids, without the stop token) and
`tokenizer_fingerprint` (str, `render.tokenizer_fingerprint` of the tokenizer they belong to).

A bad row is skipped, never silently: it is counted in a `RowStats` under a reason, and the first
example of each reason keeps the full message, e.g.
    data.jsonl:17: messages[2].content: expected a string, got null
Locations are `file:line` for JSON lines and text files, `file:row` (1-based) for Parquet and
JSON arrays. Text that is not valid UTF-8 (a damaged byte, or a lone surrogate escape such as
`\\ud800` in JSON) is a bad row like any other: files are decoded with `surrogateescape`, so a bad
byte becomes a lone surrogate in the field that holds it, and every text field is checked for one.
A file that cannot be read at all (a `.gz` that is not gzip, a `.parquet` that is not Parquet)
is one DataError naming the file.
"""

from __future__ import annotations

import gzip
import io
from array import array
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from ..config import UserError
from ..errors import named_by_flag

log = logging.getLogger(__name__)

CONVERSATION_FORMATS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
PROMPT_FORMATS = CONVERSATION_FORMATS + (".txt", ".txt.gz")

# RowStats.answers: a used row's answer rendered from the generated ids, or from text for want of them.
FROM_TOKEN_IDS = "from token ids"
WITHOUT_TOKEN_IDS = "without token ids"

_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_OPENAI_ROLES = ("system", "user", "assistant")


class DataError(UserError, ValueError):
    """A row (or file) that cannot be used. `reason` groups rows that failed the same way."""

    def __init__(self, where: str, what: str, problem: str, reason: str | None = None):
        message = f"{where}: {what}: {problem}" if what else f"{where}: {problem}"
        # The message may quote a damaged field (a key, a value): keep it printable as UTF-8.
        super().__init__(message.encode("utf-8", "backslashreplace").decode("utf-8"))
        # The grouping key drops indices and the value found, so that `messages[2] ... got null`
        # and `messages[5] ... got a number` count together.
        general = re.sub(r", got .*$", "", problem)
        self.reason = reason or re.sub(r"\[\d+\]", "[*]", f"{what}: {general}" if what else general)


# A token's text is at most this many characters in the vocabularies of real models (the longest
# are runs of spaces or dashes in code vocabularies, well under it). So N tokens never span more
# than N times this many characters: a row is cut there before it is tokenized, and an answer
# longer than that is not N tokens whatever a server says.
MAX_CHARS_PER_TOKEN = 256


@dataclass
class RowStats:
    """How many rows were read, how many are used, and why the others were skipped.

    Every row read is either used or skipped once, so `used + skipped == read` always holds;
    `used` is derived to keep it that way. Pass one RowStats to the readers of several files to count them together.
    """

    read: int = 0
    skipped_by_reason: Counter = field(default_factory=Counter)
    truncated: int = 0  # used rows longer than the length kept (their first tokens are used)
    first_example: dict[str, str] = field(default_factory=dict)
    # Used rows by where their last answer's tokens came from: FROM_TOKEN_IDS, or why from the
    # text (training counts them; see samples.py). Shown when some row carried token ids.
    answers: Counter = field(default_factory=Counter)

    @property
    def skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    @property
    def used(self) -> int:
        return self.read - self.skipped

    def why_none_used(self) -> str:
        """The end of a "no usable rows" error: where to look, or that there was nothing to read."""
        return "(see the skipped rows above)" if self.skipped else "(it has no rows)"

    def count_read(self, rows: int = 1) -> None:
        self.read += rows

    def skip(self, reason: str, example: str | None = None) -> None:
        """Count one already-read row as skipped (call at most once per row)."""
        self.skipped_by_reason[reason] += 1
        if example is not None:
            self.first_example.setdefault(reason, example)
        log.debug("skipped: %s", example or reason)

    def answers_note(self) -> str:
        """`(answers: N from token ids, M from text: why...)`, or "" when no row carried ids."""
        if not any(kind != WITHOUT_TOKEN_IDS for kind in self.answers):
            return ""
        from_ids = self.answers.get(FROM_TOKEN_IDS, 0)
        text = {kind: n for kind, n in self.answers.items() if kind != FROM_TOKEN_IDS}
        why = ", ".join(f"{n} {kind}" for kind, n in sorted(text.items(), key=lambda item: (-item[1], item[0])))
        return f" (answers: {from_ids} from token ids, {sum(text.values())} from text" + (f": {why})" if why else ")")

    def summary(self) -> str:
        lines = [f"rows: read={self.read} used={self.used} skipped={self.skipped}{self.answers_note()}"
                 + (f" (of the used, {self.truncated} truncated to the length kept)" if self.truncated else "")]
        for reason, count in sorted(self.skipped_by_reason.items(), key=lambda item: (-item[1], item[0])):
            example = self.first_example.get(reason)
            lines.append(f"  skipped {count}: {reason}" + (f"  (first: {example})" if example else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class Conversation:
    """A validated chat with at least one assistant message; `messages` are {"role", "content"} dicts."""

    id: str
    messages: list[dict[str, str]]
    source: str  # file:line, for error messages
    # The last answer's tokens as generated, and the fingerprint of their tokenizer (None: absent).
    # 4 bytes a token: a file's rows are held whole while it renders.
    answer_ids: array | None = None
    tokenizer_fingerprint: str | None = None


@dataclass(frozen=True)
class Prompt:
    """A chat ending with a user message, awaiting the assistant's answer."""

    id: str
    messages: list[dict[str, str]]
    source: str


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _format_suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in sorted(PROMPT_FORMATS, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def _open_text(path: Path) -> io.TextIOBase:
    # utf-8-sig: a byte-order mark some editors write at the start is not part of row 1.
    # surrogateescape: a byte that is not UTF-8 becomes a lone surrogate in the row that holds
    # it (rejected there by `_text`), instead of a UnicodeDecodeError that ends the whole file.
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="surrogateescape")
    return open(path, encoding="utf-8-sig", errors="surrogateescape")


def _unreadable(path: Path, kind: str, error: BaseException) -> DataError:
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DataError(str(path), "", f"not a readable {kind} file ({detail})")


def _text_error(value: str) -> str | None:
    """Why `value` is not valid text (a lone surrogate: a JSON escape like \\ud800, or a byte
    that was not UTF-8, kept by surrogateescape), or None."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        if 0xDC80 <= code <= 0xDCFF:
            what = f"byte 0x{code - 0xDC00:02x} is not UTF-8 (or a lone surrogate escape \\u{code:04x})"
        else:
            what = f"lone surrogate escape \\u{code:04x}"
        return f"invalid text at character {error.start}: {what}"
    return None


def check_readable(path: str | Path, formats: tuple[str, ...] = PROMPT_FORMATS, flag: str = "") -> str:
    """The file's format (its suffix), once it is one of `formats` and the file is there; the
    error names `flag` when given (a check at start, before any model loads)."""
    path = Path(path)
    where = named_by_flag(path, flag)
    suffix = _format_suffix(path)
    if suffix not in formats:
        raise DataError(where, "", f"unsupported file type; expected one of {', '.join(formats)}")
    if not path.is_file():
        raise DataError(where, "", "no such file")
    path.open("rb").close()  # unreadable (permissions): the OS error names the file now, not once a model has loaded
    return suffix


class UnparsedLine(NamedTuple):
    """A JSON line read but not parsed yet (`iter_rows(parse_lines=False)`): whoever takes it,
    a worker process say, parses it with `conversation_of`."""

    text: str


def iter_rows(path: str | Path, formats: tuple[str, ...] = PROMPT_FORMATS, *,
              parse_lines: bool = True) -> Iterator[tuple[str, Any]]:
    """Yield `(location, row)` for every row of a file; a row that cannot be parsed is yielded as a DataError.

    Text files yield `{"prompt": line}` rows; JSON lines come as `UnparsedLine`s unless `parse_lines`.
    """
    path = Path(path)
    suffix = check_readable(path, formats)
    if suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    if suffix.endswith(".gz"):
        import zlib

        try:
            yield from _text_rows(path, suffix, parse_lines)
        except (OSError, EOFError, zlib.error) as error:  # not gzip, or truncated
            raise _unreadable(path, "gzip", error) from None
        return
    yield from _text_rows(path, suffix, parse_lines)


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row_number = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            try:
                rows = batch.to_pylist()
            except UnicodeDecodeError:  # a string cell that is not UTF-8: find it row by row
                rows = [_parquet_row(batch, index, f"{path}:{row_number + index + 1}") for index in range(batch.num_rows)]
            for row in rows:
                row_number += 1
                yield f"{path}:{row_number}", row
    except (pa.ArrowException, OSError) as error:
        raise _unreadable(path, "Parquet", error) from None


def _parquet_row(batch: Any, index: int, where: str) -> Any:
    """One row of a record batch, or a DataError naming the first column that is not UTF-8."""
    try:
        return batch.slice(index, 1).to_pylist()[0]
    except UnicodeDecodeError as error:
        for name in batch.schema.names:
            try:
                batch.column(name)[index].as_py()
            except UnicodeDecodeError:
                return DataError(where, name, f"invalid text: {error.reason} (byte 0x{error.object[error.start]:02x})",
                                 reason=f"{name}: invalid UTF-8 or lone surrogate")
        return DataError(where, "row", f"invalid text: {error.reason}", reason="invalid UTF-8 or lone surrogate")


def _text_rows(path: Path, suffix: str, parse_lines: bool = True) -> Iterator[tuple[str, Any]]:
    with _open_text(path) as handle:
        if suffix in (".json", ".json.gz"):
            try:
                rows = json.load(handle)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{error.lineno}", "", f"invalid JSON: {error.msg}") from None
            if not isinstance(rows, list):
                raise DataError(str(path), "", f"expected a JSON array of rows, got {_json_type(rows)}")
            for row_number, row in enumerate(rows, start=1):
                yield f"{path}:{row_number}", row
            return
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            if suffix in (".txt", ".txt.gz"):
                yield where, {"prompt": line.rstrip("\r\n")}
                continue
            yield where, _parsed_line(line, where) if parse_lines else UnparsedLine(line)


def _parsed_line(line: str, where: str) -> Any:
    """A JSON line's row, or the DataError that says why it has none."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        return DataError(where, "", f"invalid JSON: {error.msg} (column {error.colno})", reason="invalid JSON")


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(where, what, f"expected a string, got {_json_type(value)}")
    problem = _text_error(value)
    if problem is not None:
        raise DataError(where, what, problem, reason=re.sub(r"\[\d+\]", "[*]", f"{what}: invalid UTF-8 or lone surrogate"))
    return value


def parse_messages(row: dict, where: str, openai_key: str = "messages") -> list[dict[str, str]]:
    """The validated message list of an OpenAI (`row[openai_key]`) or ShareGPT (`row["conversations"]`)
    row, with roles normalised to system/user/assistant."""
    if openai_key in row:
        key, role_key, content_key, roles = openai_key, "role", "content", {r: r for r in _OPENAI_ROLES}
    elif "conversations" in row:
        key, role_key, content_key, roles = "conversations", "from", "value", _SHAREGPT_ROLES
    else:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise DataError(where, "row", f"expected a '{openai_key}' or 'conversations' field (has: {keys})", reason=f"no '{openai_key}' or 'conversations' field")
    items = row[key]
    if not isinstance(items, list):
        raise DataError(where, key, f"expected an array of messages, got {_json_type(items)}")
    if not items:
        raise DataError(where, key, "empty")
    messages = []
    for index, item in enumerate(items):
        what = f"{key}[{index}]"
        if not isinstance(item, dict):
            raise DataError(where, what, f"expected an object, got {_json_type(item)}")
        role = item.get(role_key)
        if role not in roles:
            expected = ", ".join(repr(r) for r in roles)
            raise DataError(where, f"{what}.{role_key}", f"unknown role {role!r}; expected one of {expected}", reason=f"{key}[*].{role_key}: unknown role")
        message = {"role": roles[role], "content": _text(item.get(content_key), where, f"{what}.{content_key}")}
        reasoning = item.get("reasoning_content")
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = _text(reasoning, where, f"{what}.reasoning_content")
        messages.append(message)
    return messages


def _row_id(row: dict, path: Path, where: str) -> str:
    value = row.get("id")
    if isinstance(value, str) and value:
        return _text(value, where, "id")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{path.name}:{where.rsplit(':', 1)[1]}"


def parse_conversation(row: Any, where: str, path: Path) -> Conversation:
    if not isinstance(row, dict):
        raise DataError(where, "row", f"expected an object, got {_json_type(row)}")
    messages = parse_messages(row, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(where, "messages", "no assistant message to learn from", reason="no assistant message")
    answer_ids, fingerprint = _answer_token_ids(row, where)
    return Conversation(_row_id(row, path, where), messages, where, answer_ids, fingerprint)


def _answer_token_ids(row: dict, where: str) -> tuple[array | None, str | None]:
    ids = row.get("answer_token_ids")
    fingerprint = row.get("tokenizer_fingerprint")
    if ids is None:
        return None, None
    # Checked at C speed (a regenerated file holds ~150 ids a row: a per-id Python test was most
    # of reading it): only ints (JSON's true/false arrive as bools, a type of their own here), in
    # [0, 2**31). The slow search for the culprit runs only for a bad row.
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int} or (ids and not (min(ids) >= 0 and max(ids) < 2**31)):
        bad = next((i for i in ids if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31)), ids) \
            if isinstance(ids, list) else ids
        raise DataError(where, "answer_token_ids", f"expected an array of token ids (integers >= 0), got {bad!r}"[:160],
                        reason="answer_token_ids: not an array of token ids")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise DataError(where, "tokenizer_fingerprint", "answer_token_ids need the fingerprint of their tokenizer (a string)",
                        reason="answer_token_ids without tokenizer_fingerprint")
    return array("i", ids), fingerprint


def parse_prompt(row: Any, where: str, path: Path) -> Prompt:
    """A prompt row. A chat ending with an assistant answer becomes the prompt for that answer
    (the answer is dropped: this is how an existing dataset is regenerated by a new target)."""
    if not isinstance(row, dict):
        raise DataError(where, "row", f"expected an object, got {_json_type(row)}")
    if "prompt" in row:
        text = _text(row["prompt"], where, "prompt")
        if not text.strip():
            raise DataError(where, "prompt", "empty")
        messages = [{"role": "user", "content": text}]
        if row.get("system") is not None:
            messages.insert(0, {"role": "system", "content": _text(row["system"], where, "system")})
    else:
        messages = parse_messages(row, where)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages or messages[-1]["role"] != "user":
            raise DataError(where, "messages", "a prompt must end with a user message", reason="prompt does not end with a user message")
    return Prompt(_row_id(row, path, where), messages, where)


def _read(path: str | Path, parse: Any, formats: tuple[str, ...], stats: RowStats | None, strict: bool) -> Iterator[Any]:
    path = Path(path)
    stats = stats if stats is not None else RowStats()
    for where, row in iter_rows(path, formats):
        stats.count_read()
        try:
            if isinstance(row, DataError):
                raise row
            yield parse(row, where, path)
        except DataError as error:
            if strict:
                raise
            stats.skip(error.reason, str(error))


def conversation_rows(path: str | Path, stats: RowStats) -> Iterator[tuple[str, Any]]:
    """`(location, row)` of every row of a conversation file, counted in `stats.read`, each still
    to be made a Conversation by `conversation_of` (which may run in another process: JSON lines
    come unparsed, parsing is most of reading a file of generated answers)."""
    for where, row in iter_rows(path, CONVERSATION_FORMATS, parse_lines=False):
        stats.count_read()
        yield where, row


def conversation_of(row: Any, where: str, path: str | Path) -> Conversation:
    """The Conversation of a row `conversation_rows` gave; raises the DataError of a bad one."""
    if isinstance(row, UnparsedLine):
        row = _parsed_line(row.text, where)
    if isinstance(row, DataError):
        raise row
    return parse_conversation(row, where, Path(path))


def read_conversations(path: str | Path, stats: RowStats | None = None, *, strict: bool = False) -> Iterator[Conversation]:
    """Valid conversations of one file, in file order; bad rows are counted in `stats` (or raise if `strict`)."""
    return _read(path, parse_conversation, CONVERSATION_FORMATS, stats, strict)


def read_prompts(path: str | Path, stats: RowStats | None = None, *, strict: bool = False) -> Iterator[Prompt]:
    """Valid prompts of one file, in file order; bad rows are counted in `stats` (or raise if `strict`)."""
    return _read(path, parse_prompt, PROMPT_FORMATS, stats, strict)

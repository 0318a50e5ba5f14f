"""Chat rendering: token ids and the assistant-only loss mask, from one function.

`render_conversation` renders the whole conversation once with the tokenizer's own chat
template, finds where each assistant answer begins (below), and tokenizes the text in two pieces
cut where the last answer begins. The head is then exactly what `render_prompt` serves the
target before that answer (history included, as a server re-tokenizes it), and the answer
starts with a fresh token, as when the target generated it. (Tokenized in one go, a GPT-2-style
tokenizer turns "</think>\\n\\n" + "4." into "\\n" "\\n" "4.", while the served prompt ends with
the single token "\\n\\n".) Earlier answers are located inside the head by character offsets.
loss_mask is 1 from the first token of an answer through the end-of-turn token the assistant
emitted (`<|im_end|>`, `<|eot_id|>`, ...), and 0 on everything the template adds: system
prompt, role headers, the generation prompt, the separator after the end-of-turn token.

How an assistant turn k (message index k) is located, for any template:
  1. history = render(messages[:k]) must be a prefix of the full render (checked; a template that
     rewrites earlier text as the conversation grows raises RenderError naming the first
     differing character). The turn starts after it.
  2. The generation prompt = render(messages[:k], add_generation_prompt=True) minus the history.
     The assistant's own text starts right after it. If the full render does not contain all of
     it, the turn must still begin with it when rendered as the last message (the template
     rewrote it later, as Qwen3 does); the text then starts where the full render stops matching
     the generation prompt, cut back to a token boundary. Otherwise RenderError (data made in
     another mode, e.g. reasoning rendered with enable_thinking=False).
  3. The turn ends at the first special token (an added token flagged `special`) at or after that
     start: the end-of-turn token, which the assistant emits and the mask includes. A turn with
     no special token after it raises RenderError.

Thinking templates (Qwen3), with the mask this produces:
  - enable_thinking=False: the generation prompt is `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
    The empty think block is part of the prompt the target was given, so it is masked 0; the
    answer and `<|im_end|>` are 1.
  - enable_thinking=True or None (template default = thinking): the generation prompt is
    `<|im_start|>assistant\\n`; the last turn renders `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`,
    all of which the target writes in thinking mode, so all of it (think tags included) is 1.
    Render data with the mode it was generated in: rendering answers generated with thinking off
    in thinking mode would teach the drafter an empty think block the target never wrote.
  - Earlier turns (before the last user message): the template drops their reasoning (and, with
    thinking off, the empty think block). Only what is rendered is trained: the answer and
    `<|im_end|>` are 1; the dropped reasoning is simply absent from the sample.
Templates whose assistant turns contain special tokens before the end of turn (e.g. gpt-oss
channel markers) are not supported by rule 3. An assistant message that opens the conversation
answers no prompt and stays unmasked context.

The answer as the target wrote it (`answer_ids`, what `regenerate` stores next to the text). A
target does not always write the canonical tokenization of its own text (forty single "\\n"
tokens re-tokenize into a few multi-newline ones), and a drafter trained on the re-tokenized
text learns sequences the target never produces. Given the last answer's generated ids,
everything the template adds (the prompt, the end-of-turn tokens after the answer) is still
rendered from the template, and the answer's tokens are the ids themselves, all of them in the
loss mask. They are used only where they are that answer: the last message is the assistant's,
the ids decode to its text, and the template renders the text verbatim where the answer begins;
otherwise the text is rendered as usual and `Rendered.text_because` says why. Whether the ids
belong to this tokenizer at all is the caller's check (`tokenizer_fingerprint`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from ..config import UserError

Messages = Sequence[dict[str, Any]]


class RenderError(UserError, ValueError):
    """The chat template cannot be used to place an assistant-only loss mask for this conversation."""


ANSWER_FROM_IDS = "token ids"  # Rendered.answer_source: the last answer's tokens as generated


@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the assistant wrote the token (incl. its end-of-turn token)
    # Why the given answer ids were not used (None: they were, or none were given).
    text_because: str | None = None
    from_ids: bool = False  # the last answer's tokens are the given ids

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


# Special-token ids per tokenizer; recomputed if tokens were added since (len(tokenizer) changes).
_special_ids_cache: "weakref.WeakKeyDictionary[Any, tuple[int, frozenset[int]]]" = weakref.WeakKeyDictionary()


def _special_token_ids(tokenizer: Any) -> frozenset[int]:
    size = len(tokenizer)
    cached = _special_ids_cache.get(tokenizer)
    if cached is None or cached[0] != size:
        ids = frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        cached = (size, ids)
        _special_ids_cache[tokenizer] = cached
    return cached[1]


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text token ids write: special tokens kept, spaces as they are. Some tokenizer configs
    still ask for `clean_up_tokenization_spaces`, which strips spaces before punctuation; recent
    transformers ignore it for BPE with a warning, older ones apply it and change the text."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


_fingerprint_cache: "weakref.WeakKeyDictionary[Any, tuple[int, str]]" = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable identity of what the tokenizer's ids mean and how it splits text: a hash of its
    vocabulary (token -> id, added tokens included), which added tokens are special, and its BPE
    merges where it has them. Independent of where the tokenizer was loaded from (a folder, a
    GGUF) and of the library's serialization; another vocabulary or merge list gives another."""
    size = len(tokenizer)
    cached = _fingerprint_cache.get(tokenizer)
    if cached is not None and cached[0] == size:
        return cached[1]
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode("utf-8"))
    special = sorted(int(i) for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    digest.update(json.dumps(special).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        merges = json.loads(backend.to_str()).get("model", {}).get("merges") or []
        # tokenizers writes a merge as "a b" or as ["a", "b"] depending on its version
        digest.update(json.dumps([m if isinstance(m, str) else " ".join(m) for m in merges], ensure_ascii=False).encode("utf-8"))
    fingerprint = "sha256:" + digest.hexdigest()[:32]
    try:
        _fingerprint_cache[tokenizer] = (size, fingerprint)
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return fingerprint


def render_text(tokenizer: Any, messages: Messages, add_generation_prompt: bool, enable_thinking: bool | None) -> str:
    """The chat template's text for `messages`: the one place a template is applied."""
    if tokenizer.chat_template is None:
        raise RenderError(f"{type(tokenizer).__name__} has no chat template; set tokenizer.chat_template")
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as error:  # the template's own checks (jinja raise_exception), or a field it needs
        raise RenderError(f"chat template failed on {len(messages)} messages: {type(error).__name__}: {error}") from error


def _first_difference(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _not_a_prefix(what: str, prefix: str, full: str) -> RenderError:
    at = _first_difference(prefix, full)
    return RenderError(
        f"chat template is not prefix-stable: {what} differs from the full render at character {at} "
        f"({prefix[at:at + 40]!r} vs {full[at:at + 40]!r}); the template rewrites earlier text as the "
        "conversation grows, so the assistant's tokens cannot be located"
    )


def _token_aligned_common_prefix(tokenizer: Any, generation_prompt: str, rest: str) -> int:
    """Characters at the start of `rest` shared with the generation prompt, cut back to a whole
    token of the prompt so that a partial match into the answer ("<thinking") is not taken."""
    common = _first_difference(generation_prompt, rest)
    ends = [end for _, end in tokenizer(generation_prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    return max([end for end in ends if end <= common], default=0)


def _assistant_start(tokenizer: Any, messages: Messages, index: int, full: str, enable_thinking: bool | None) -> int:
    """Character of `full` where the assistant's own text of message `index` begins."""
    with_prompt = render_text(tokenizer, messages[:index], True, enable_thinking)
    if full.startswith(with_prompt):
        # The usual case, settled without rendering the history alone: the whole conversation
        # begins with exactly the prompt the answer was served, so the answer starts after it.
        return len(with_prompt)
    history = render_text(tokenizer, messages[:index], False, enable_thinking)
    if not full.startswith(history):
        raise _not_a_prefix(f"rendering messages[:{index}]", history, full)
    if not with_prompt.startswith(history):
        raise _not_a_prefix(f"messages[:{index}] with the generation prompt (without it)", history, with_prompt)
    generation_prompt, rest = with_prompt[len(history) :], full[len(history) :]
    if rest.startswith(generation_prompt):
        return len(history) + len(generation_prompt)
    # Legitimate only if the turn, rendered as it stood when written (as the last message), does
    # begin with the generation prompt and the template rewrote it once later messages followed
    # (Qwen3 drops the empty think block of earlier turns). Otherwise the data does not fit this
    # prompt, e.g. reasoning rendered with enable_thinking=False.
    as_written = render_text(tokenizer, messages[: index + 1], False, enable_thinking)
    if not as_written.startswith(history + generation_prompt):
        raise RenderError(
            f"assistant message {index} does not begin with the generation prompt {generation_prompt!r} "
            f"(rendered: {as_written[len(history):len(history) + 60]!r}); was the data generated in another mode "
            f"(enable_thinking={enable_thinking})?"
        )
    return len(history) + _token_aligned_common_prefix(tokenizer, generation_prompt, rest)


def render_conversation(
    tokenizer: Any,
    messages: Messages,
    *,
    enable_thinking: bool | None = None,
    max_length: int | None = None,
    answer_ids: Sequence[int] | None = None,
) -> Rendered:
    """Token ids of the whole conversation and its assistant-only loss mask (see the module doc).

    `max_length` keeps the first `max_length` tokens. `answer_ids`: the last answer's tokens as
    the target generated them (without its stop token), used where they fit (module doc). Raises
    RenderError when the template does not allow the assistant's tokens to be located.
    """
    full = render_text(tokenizer, messages, False, enable_thinking)
    # An assistant message that opens the conversation answers no prompt: it stays context.
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant" and i > 0]
    starts = [_assistant_start(tokenizer, messages, i, full, enable_thinking) for i in turns]
    # Two pieces, cut where the last answer begins (see the module doc): the head is exactly the
    # prompt served for that answer, and the answer starts with a fresh token.
    cut = starts[-1] if starts else len(full)
    text_because = None
    generated: list[int] | None = None
    if answer_ids is not None:
        text_because = _why_not_ids(tokenizer, messages, turns, full, cut, answer_ids)
        generated = list(answer_ids) if text_because is None else None
    pieces = [full[:cut], full[cut:]] if generated is None else [full[:cut], full[cut + len(messages[-1]["content"]):]]
    encoded = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True)
    head_ids, tail_ids = encoded["input_ids"]
    input_ids: list[int] = head_ids + (generated or []) + tail_ids
    # Earlier answers lie inside the head: their first token is the first one ending after their
    # start (a token straddling it, prompt whitespace merged with the answer's, holds assistant text).
    head_ends = [end for _, end in encoded["offset_mapping"][0]]
    token_starts = [bisect.bisect_right(head_ends, start) for start in starts[:-1]]
    if starts:
        token_starts.append(len(head_ids))
    special_ids = _special_token_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    for turn, (index, start) in enumerate(zip(turns, token_starts)):
        stop = token_starts[turn + 1] if turn + 1 < len(token_starts) else len(input_ids)
        # The generated answer is the assistant's whole: its end of turn comes after it.
        search_from = start + len(generated) if generated is not None and turn == len(turns) - 1 else start
        # The answer runs through the first special token: the end-of-turn token the assistant emitted.
        end = next((i for i in range(search_from, stop) if input_ids[i] in special_ids), None)
        if end is None:
            raise RenderError(
                f"chat template renders no special end-of-turn token after assistant message {index} "
                f"(looked at {decode_text(tokenizer, input_ids[start:stop])[:80]!r}); the drafter must learn where a turn ends"
            )
        loss_mask[start : end + 1] = [1] * (end + 1 - start)

    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return Rendered(input_ids, loss_mask, text_because, generated is not None)


def _why_not_ids(tokenizer: Any, messages: Messages, turns: list[int], full: str, cut: int,
                 answer_ids: Sequence[int]) -> str | None:
    """Why `answer_ids` cannot stand for the last answer of this render (None: they can)."""
    if not turns or turns[-1] != len(messages) - 1:
        return "token ids, but the conversation does not end with the answer"
    text = messages[-1]["content"]
    if not full.startswith(text, cut):
        return "token ids, but the chat template rewrites the answer text"
    if decode_text(tokenizer, answer_ids) != text:
        return "token ids that do not decode to the answer text"
    return None


def render_prompt(tokenizer: Any, messages: Messages, enable_thinking: bool | None = None) -> list[int]:
    """Token ids of a prompt ending with the generation prompt: what the target reads before
    answering (`regenerate`, `eval`, the in-training evaluator all serve prompts through this).
    A base model without a chat template reads the user turns as plain text after its BOS."""
    if tokenizer is None:
        raise RenderError("the target has no tokenizer next to it: prompts are rendered with its chat template")
    if not messages or messages[-1]["role"] == "assistant":
        raise RenderError("render_prompt needs messages ending with a user turn (drop the assistant answer to regenerate it)")
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer.encode("\n\n".join(m["content"] for m in messages if m["role"] == "user")))
    text = render_text(tokenizer, messages, True, enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """End-of-turn ids: the tokenizer's eos and every eos id of the model's generation config
    (Llama-3 and Qwen list several: `<|eot_id|>`, `<|im_end|>`, `<|endoftext|>`). What
    `regenerate` stops at is what `eval` and the in-training evaluator stop at."""
    ids: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    if not ids:
        raise UserError("the target declares no end-of-turn token (no eos_token_id in its tokenizer or "
                        "generation_config); pass --stop-token-ids")
    return ids

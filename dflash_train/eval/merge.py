"""`eval-merge`'s rules: one run's payload from the --json files of `eval --offset --limit`
shards, refused where the shards are no shards of one run (other settings, prompts, drafter or
target; overlaps and gaps), and what `eval --json` records for that check."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import reprlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..config import UserError, on_here
from .stats import PromptResult, summarize

if TYPE_CHECKING:
    from .benchmarks import BenchPrompt


class MergeError(UserError, ValueError):
    """Shards that cannot be merged into one run (different settings, overlapping prompts), or a
    file that is no eval shard."""


def prompt_list_record(prompts: Sequence[BenchPrompt]) -> dict[str, Any]:
    """What `eval --json` records of a benchmark's whole prompt list (every prompt, not only the
    shard's): how many and a sha256 of their ordered messages, so that `eval-merge` tells shards
    of one prompts file from shards of a file edited between their runs. Ids are left out: a
    prompt file's ids carry its name, which may differ between machines."""
    text = json.dumps([prompt.messages for prompt in prompts], ensure_ascii=False, sort_keys=True)
    return {"count": len(prompts), "sha256": hashlib.sha256(text.encode()).hexdigest()}


@dataclass
class _Shard:
    path: Path
    order: int  # on the command line: shards with equal offsets keep it
    payload: dict[str, Any]
    results: dict[str, list[PromptResult]]  # per benchmark

    @property
    def config(self) -> dict[str, Any]:
        return self.payload["config"]

    @property
    def offset(self) -> int:
        return self.config.get("offset", 0)

    @property
    def limit(self) -> int:
        return self.config.get("limit", 0)


# Far beyond any drafter's; the histogram has a slot per size, so a larger number would only hang the merge.
_LARGEST_BLOCK_SIZE = 1 << 16
_RECORD_TYPES = typing.get_type_hints(PromptResult)
_RECORD_REQUIRED = [f.name for f in dataclasses.fields(PromptResult)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _not_eval_json(path: Path, why: str) -> MergeError:
    return MergeError(f"{path}: not a --json file of `dflash-train eval` ({why})")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _of_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value has a PromptResult field's type (str, int, float, bool, list[int], X | None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_of_type(value, arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_of_type(item, typing.get_args(hint)[0]) for item in value)
    if hint is int:
        return _is_whole(value)
    if hint is float:
        return _is_whole(value) or isinstance(value, float)
    return isinstance(value, hint)


def _prompt_result(path: Path, where: str, record: Any) -> PromptResult:
    if not isinstance(record, dict):
        raise _not_eval_json(path, f"{where} is not an object")
    for name in _RECORD_REQUIRED:
        if name not in record:
            raise _not_eval_json(path, f"{where} has no {name}")
    values = {key: value for key, value in record.items() if key in _RECORD_TYPES}
    for key, value in values.items():
        if not _of_type(value, _RECORD_TYPES[key]):
            raise _not_eval_json(path, f"{where}: {key} is {reprlib.repr(value)}")
    # summarize sums the three baseline numbers of every prompt timed target-only.
    if values.get("baseline_seconds") is not None and None in (values.get("baseline_new_tokens"),
                                                                values.get("baseline_decode_seconds")):
        raise _not_eval_json(path, f"{where} has baseline_seconds without baseline_new_tokens and baseline_decode_seconds")
    return PromptResult(**values)


def _read_shard(path: Path, order: int) -> _Shard:
    """A shard, checked to hold what the merge reads in the types eval writes: a damaged or
    foreign file is one MergeError naming it, never a traceback from deep inside the merge."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise MergeError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise _not_eval_json(path, f"not UTF-8 text: {error}") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as error:
        raise _not_eval_json(path, f"not JSON: {error}") from None
    except RecursionError:
        raise _not_eval_json(path, "nested too deeply") from None
    if not isinstance(payload, dict):
        raise _not_eval_json(path, f"not an object but {type(payload).__name__}")
    if "benchmarks" not in payload or "block_size" not in payload:
        raise _not_eval_json(path, "no benchmarks / block_size")
    if not _is_whole(payload["block_size"]) or not 1 <= payload["block_size"] <= _LARGEST_BLOCK_SIZE:
        raise _not_eval_json(path, f"block_size is {reprlib.repr(payload['block_size'])}, not a positive whole number "
                                   f"up to {_LARGEST_BLOCK_SIZE}")
    if not isinstance(payload["benchmarks"], dict):
        raise _not_eval_json(path, "benchmarks is not an object")
    results = {}
    for name, bench in payload["benchmarks"].items():
        if not isinstance(bench, dict) or not isinstance(bench.get("prompts"), list):
            raise _not_eval_json(path, f"benchmark {name}: no list of prompt records")
        prompt_list = bench.get("prompt_list")
        if prompt_list is not None and not (isinstance(prompt_list, dict) and _is_whole(prompt_list.get("count"))
                                            and isinstance(prompt_list.get("sha256"), str)):
            raise _not_eval_json(path, f"benchmark {name}: prompt_list is not a count and a sha256")
        results[name] = [_prompt_result(path, f"benchmark {name}: prompt record {index}", record)
                         for index, record in enumerate(bench["prompts"])]
    config = payload.get("config", {})
    if not isinstance(config, dict):
        raise _not_eval_json(path, "config is not an object")
    for key in ("offset", "limit"):
        if key in config and not (_is_whole(config[key]) and config[key] >= 0):
            raise _not_eval_json(path, f"config.{key} is {reprlib.repr(config[key])}, not a whole number")
    pair = payload.get("pair")
    if pair is not None and not (isinstance(pair, dict) and all(isinstance(pair.get(role, {}), dict)
                                                                for role in ("drafter", "target"))):
        raise _not_eval_json(path, "pair is not an object of a drafter and a target record")
    stops = payload.get("stop_token_ids")
    if stops is not None and not (isinstance(stops, list) and all(_is_whole(stop) for stop in stops)):
        raise _not_eval_json(path, "stop_token_ids is not a list of token ids")
    if not isinstance(payload.get("device", ""), str):
        raise _not_eval_json(path, "device is not a string")
    if "config" not in payload:
        # Every eval wrote its config; merges written before merged files kept one did not.
        raise MergeError(f"{path} records no settings (a file of an older eval-merge?): merge the shards it was made of instead")
    return _Shard(path, order, payload, results)


def _measured_settings(payload: dict[str, Any]) -> dict[str, Any]:
    """The settings a shard's tokens, τ or speeds depend on, by the name a refusal gives them;
    shards of one run agree on each. Where eval records what it resolved (dtype, stop tokens,
    device) that is compared, so `--dtype auto` and `--dtype float32` on a CPU are one run.
    Not here: what only says which slice or where (offset, limit, json, the GPU's index), the
    benchmark list (a benchmark missing from a shard contributes nothing there), and what is
    checked on its own: drafter and target, block size, and each benchmark's prompts."""
    config = payload["config"]
    device_type = payload.get("device", "").split(":")[0] or None  # cuda:0 and cuda:1: one run over two GPUs
    temperature = config.get("temperature")
    sampled = isinstance(temperature, (int, float)) and temperature > 0
    stops = payload.get("stop_token_ids")
    # The hf decoder compiles nothing; auto compiles on CUDA only.
    compiled = config.get("decoder") != "hf" and device_type is not None and on_here(config.get("compile_draft"), device_type)
    return {
        "max_new_tokens": config.get("max_new_tokens"),
        "temperature": temperature,
        "seed": config.get("seed") if sampled else None,  # greedy decoding draws no random number
        "baseline": config.get("baseline"),
        "device": device_type,  # before what it resolves: dtype and compile_draft's auto
        "dtype": payload.get("dtype"),
        "stop_token_ids": sorted(stops) if stops is not None else None,
        "thinking": config.get("thinking"),
        "decoder": config.get("decoder"),
        "compile_draft": "on" if compiled else "off",
    }


def _check_same_settings(shard: _Shard, first: _Shard) -> None:
    mine, theirs = _measured_settings(shard.payload), _measured_settings(first.payload)
    for key in mine:
        if mine[key] != theirs[key]:
            raise MergeError(f"{key} is {mine[key]!r} in {shard.path} but {theirs[key]!r} in {first.path}: not one run")


def _check_same_pair(path: Path, payload: dict[str, Any], first_path: Path, first: dict[str, Any]) -> None:
    """Refuse shards that measured different drafters or targets (compared by content, recorded
    by `eval.run.pair_identity`; paths may differ between machines). Shards from an eval without
    that record are compared by the --target / --drafter they were given."""
    mine, theirs = payload.get("pair"), first.get("pair")
    if (mine is None) != (theirs is None):
        older = path if mine is None else first_path
        raise MergeError(f"{older} does not record which drafter and target it measured (an older `dflash-train eval`); "
                         "re-run that shard to merge it")
    for role in ("drafter", "target"):
        if mine is None:
            a, b = payload.get("config", {}).get(role), first.get("config", {}).get(role)
            if a != b:
                raise MergeError(f"--{role} is {a!r} in {path} but {b!r} in {first_path}: not one run")
            continue
        ours, other = mine.get(role, {}), theirs.get(role, {})
        differing = sorted(k for k in set(ours) | set(other) if k != "path" and ours.get(k) != other.get(k))
        if differing:
            raise MergeError(f"{path} measured {role} {ours.get('path')} but {first_path} measured {other.get('path')}, "
                             f"and they differ ({', '.join(differing)}): not one {role}")


def _check_same_prompts(shards: Sequence[_Shard]) -> dict[str, dict[str, Any]]:
    """Each benchmark's prompt list as the shards recorded it (`prompt_list_record`); refused
    where two shards recorded different ones. A shard of an eval older than that record is
    merged as before, its prompts unchecked: it can only be checked by running it again, which
    may cost GPU-hours, while its other settings still are compared."""
    recorded: dict[str, tuple[dict[str, Any], Path]] = {}
    for shard in shards:
        for name, bench in shard.payload["benchmarks"].items():
            prompt_list = bench.get("prompt_list")
            if prompt_list is None:
                continue
            if name in recorded and recorded[name][0] != prompt_list:
                raise MergeError(f"the prompts of {name} differ between {shard.path} and {recorded[name][1]} "
                                 "(the prompts file changed between the shards?)")
            recorded.setdefault(name, (prompt_list, shard.path))
    return {name: prompt_list for name, (prompt_list, _) in recorded.items()}


def merge_eval_results(paths: Sequence[str | Path]) -> dict[str, Any]:
    """One payload, shaped like `run_eval`'s --json, from the --json files of shards of one run
    (`eval --offset O --limit N` over disjoint prompt ranges of the same benchmarks), or of
    merges of such shards.

    Per benchmark the per-prompt records are concatenated in offset order (shards with equal
    offsets keep the order given) and the summary is recomputed from them, so τ statistics are
    those of one unsharded run. A benchmark missing from a shard contributes nothing there.
    Raises MergeError for a file that is no eval shard (`_read_shard`), when the drafters or
    targets differ (`_check_same_pair`), when block sizes, the settings of `_measured_settings`
    or a benchmark's prompts (`_check_same_prompts`) differ, when a prompt id appears twice in a
    benchmark (overlapping shards), or when prompts between two shards are in none (a gap).
    The payload keeps the shards' settings, with the merged range as offset and limit, and their
    prompt lists, so that it merges again with further shards as they would."""
    if not paths:
        raise MergeError("eval-merge needs at least one --json file of `dflash-train eval`")
    shards = sorted((_read_shard(Path(path), order) for order, path in enumerate(paths)),
                    key=lambda shard: (shard.offset, shard.order))

    first = shards[0]
    for shard in shards[1:]:
        _check_same_pair(shard.path, shard.payload, first.path, first.payload)
        if shard.payload["block_size"] != first.payload["block_size"]:
            raise MergeError(f"block size {shard.payload['block_size']} in {shard.path} but "
                             f"{first.payload['block_size']} in {first.path}: not one drafter")
        _check_same_settings(shard, first)
    prompt_lists = _check_same_prompts(shards)

    merged: dict[str, list[PromptResult]] = {}
    seen: dict[str, dict[str, Path]] = {}
    covered: dict[str, tuple[int, Path]] = {}  # per benchmark: where the shards so far end, and the last one
    for shard in shards:
        offset, path = shard.offset, shard.path
        for name, results in shard.results.items():
            # A shard that starts past a benchmark's end holds none of its prompts, and misses none.
            missing_end = min(offset, prompt_lists[name]["count"]) if name in prompt_lists else offset
            if name in covered and missing_end > covered[name][0]:
                end, before = covered[name]
                raise MergeError(f"{name}: {before} ends at prompt {end} but {path} starts at --offset {offset}: "
                                 f"prompts {end}..{missing_end - 1} are in no shard; evaluate them (--offset {end} "
                                 f"--limit {missing_end - end}) and merge that shard too")
            covered[name] = (max(offset + len(results), covered.get(name, (0, path))[0]), path)
            merged_results, owners = merged.setdefault(name, []), seen.setdefault(name, {})
            for result in results:
                if result.id in owners:
                    raise MergeError(f"{name}: prompt {result.id!r} is in both {owners[result.id]} and {path}: shards overlap")
                owners[result.id] = path
                merged_results.append(result)

    # The merged range as one eval would be given it; 0 (to the end) if a shard ran to the end.
    limit = 0 if any(shard.limit == 0 for shard in shards) else max(s.offset + s.limit for s in shards) - first.offset
    # --json names one shard's file, not the merged run's.
    config = {**{k: v for k, v in first.config.items() if k != "json"}, "offset": first.offset, "limit": limit}
    block_size = first.payload["block_size"]
    return {
        "block_size": block_size,
        "shards": [str(shard.path) for shard in shards],
        "config": config,
        **{key: first.payload[key] for key in ("device", "dtype", "stop_token_ids", "pair") if key in first.payload},
        "benchmarks": {
            name: {"summary": summarize(results, block_size),
                   **({"prompt_list": prompt_lists[name]} if name in prompt_lists else {}),
                   "prompts": [dataclasses.asdict(r) for r in results]}
            for name, results in merged.items()
        },
    }

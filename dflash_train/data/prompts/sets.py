"""The default prompt set (`--prompts default`): every offline source, capped, deduplicated,
decontaminated against the benchmarks, split into train and dev, and cached.

Sources (see data/prompts/registry.py and data/prompts/code.py):
    evals                 open-ended prompts of the OpenAI evals registry
    evals-short-answer    registry prompts that ask for a short answer (a letter, a number, yes/no):
                          SmolLM2 still writes >= 31 tokens to 55 % of them (77 % for open ones)
    python-stdlib         HumanEval-format "complete this function" prompts from the standard library
    python-packages       the same from the installed packages of dflash-train's requirements (sympy,
                          transformers, torch, networkx, numpy, ...), capped per file and package
    reasoning-gym         HumanEval-format prompts from reasoning-gym's CodeI/O tasks

Caps. The registry is very uneven: 780k distinct chat prompts, but one file holds 215k and eight
files hold 70 % of it, mostly short-answer drills (lexicon lookups, logic formulas). A file gives at
most 2,000 prompts, of which at most 1,000 short-answer ones, and a task (a top-level folder,
which may hold a dozen variants of one template) at most 5,000: with evals 3.0.1.post1 that is
~110k registry prompts from 400+ tasks, none above 4.5 % of the set, and the whole registry holds
only ~95k open-ended prompts, so the short-answer ones are needed to pass 100k. Lower caps fall
short of 100k; higher ones let a handful of templated tasks take over.

Order. Open-ended and code prompts come first, then the short-answer ones. Inside each part the
registry prompts go round-robin over their tasks (one prompt of every task per round, each round
in seeded random order) and the coding prompts are spread evenly through the open part, so the
first N prompts come from as many tasks as possible instead of in proportion to the big templated
tasks; `--limit N` takes the most useful and most varied N, and a smaller limit is a subset of a
larger one (nested data-size curves).

Decontamination (data/decontaminate.py): a prompt whose text matches a benchmark prompt exactly
or shares a 13-gram with one is dropped, counted per source and benchmark.

Dev split. A prompt belongs to the dev split when a hash of its normalised text falls in a fixed
1 % (`DEV_PER_MILLE`); the rule reads nothing else, so the same text is on the same side for every
seed, cap and package version, and two copies of one text cannot straddle the split. Train on
"train", choose recipes on "dev".

Cache. Building takes ~40 s of CPU (the registry filter is regex-heavy); the result is cached under the
dflash-train cache folder, keyed by the settings, the package versions, the Python version (the
stdlib prompts) and the benchmark texts, written atomically (files.py).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TextIO

from ...errors import ConfigError
from ...files import write_bytes_atomic
from ...processes import default_workers
from ...progress import Progress
from ..decontaminate import Decontaminator, normalized_key
from ..readers import Prompt, RowStats
from .code import PACKAGE_SOURCES, codeio_prompts, package_prompts, stdlib_prompts
from .registry import capped_registry_prompts

PROMPT_SET_VERSION = 4  # bump when a rule changes what the set holds: old caches are then ignored
DEV_PER_MILLE = 10
SPLITS = ("train", "dev", "all")
SOURCES = ("evals", "evals-short-answer", "python-stdlib", "python-packages", "reasoning-gym")
OVERLAP = "overlaps a benchmark prompt"


@dataclass(frozen=True)
class PromptSetSettings:
    seed: int = 0  # picks the registry rows and orders the set
    max_per_file: int = 2000
    max_short_per_file: int = 1000
    max_per_task: int = 5000

    def validate(self) -> None:
        for name in ("max_per_file", "max_short_per_file", "max_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")


def prompt_text(prompt: Prompt) -> str:
    return "\n".join(m["content"] for m in prompt.messages)


def in_dev_split(prompt: Prompt) -> bool:
    """Whether `prompt` is in the dev split: a stable hash of its normalised text (see the module doc)."""
    return key_in_dev_split(normalized_key(prompt_text(prompt)))


def key_in_dev_split(key: str) -> bool:
    """`in_dev_split` of a prompt whose `normalized_key(prompt_text(prompt))` is `key`."""
    digest = hashlib.sha256(b"dflash-train dev split\0" + key.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 1000 < DEV_PER_MILLE


def select_split(prompts: Iterable[Prompt], split: str) -> list[Prompt]:
    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: use one of {', '.join(SPLITS)}")
    if split == "all":
        return list(prompts)
    dev = split == "dev"
    return [p for p in prompts if in_dev_split(p) == dev]


@dataclass
class PromptSet:
    prompts: list[Prompt]  # both splits, in order (see the module doc)
    source_of: dict[str, str]  # prompt id -> one of SOURCES
    dev_ids: set[str]  # ids of the prompts in the dev split (`in_dev_split`, worked out once)
    stats: RowStats  # every candidate: used = in the set; skipped by reason (caps, duplicates, overlap, filters)
    overlaps: Counter = field(default_factory=Counter)  # (source, benchmark) -> prompts dropped
    settings: PromptSetSettings = PromptSetSettings()
    seconds: float = 0.0  # to build (or to read from the cache)
    cache_file: Path | None = None
    from_cache: bool = False

    def split(self, name: str) -> list[Prompt]:
        if name not in SPLITS:
            raise ConfigError(f"split {name!r}: use one of {', '.join(SPLITS)}")
        if name == "all":
            return list(self.prompts)
        dev = name == "dev"
        return [p for p in self.prompts if (p.id in self.dev_ids) == dev]

    def counts(self, prompts: Iterable[Prompt] | None = None) -> Counter:
        return Counter(self.source_of[p.id] for p in (self.prompts if prompts is None else prompts))

    def summary(self, taken: Sequence[Prompt] | None = None, split: str = "all") -> str:
        """Per-source counts of the set (and of `taken`, the prompts a command uses) and the overlap drops."""
        whole, dev = self.counts(), self.counts(self.split("dev"))
        used = self.counts(taken) if taken is not None else None
        how = f"read from {self.cache_file}" if self.from_cache else "built" + (f", cached in {self.cache_file}" if self.cache_file else "")
        lines = [f"default prompts: {len(self.prompts)} ({how}, {self.seconds:.1f} s); "
                 f"caps per file {self.settings.max_per_file} (short-answer {self.settings.max_short_per_file}), "
                 f"per task {self.settings.max_per_task}"]
        header = f"  {'source':<20}{'set':>9}{'dev':>7}" + (f"{'taken (' + split + ')':>16}" if used is not None else "")
        lines.append(header)
        for source in SOURCES:
            row = f"  {source:<20}{whole[source]:>9}{dev[source]:>7}"
            lines.append(row + (f"{used[source]:>16}" if used is not None else ""))
        total = f"  {'total':<20}{len(self.prompts):>9}{sum(dev.values()):>7}"
        lines.append(total + (f"{len(taken):>16}" if taken is not None else ""))
        dropped = sum(self.overlaps.values())
        by_benchmark = Counter()
        for (_, benchmark), count in self.overlaps.items():
            by_benchmark[benchmark] += count
        detail = ", ".join(f"{name} {count}" for name, count in sorted(by_benchmark.items())) or "none"
        lines.append(f"  dropped for benchmark overlap (exact or 13-gram): {dropped} ({detail})")
        return "\n".join(lines)


def _benchmark_fingerprint(benchmarks: Mapping[str, Sequence[str]]) -> str:
    digest = hashlib.sha256()
    for name in sorted(benchmarks):
        digest.update(name.encode() + b"\0")
        for text in benchmarks[name]:
            digest.update(text.encode() + b"\0")
    return digest.hexdigest()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cache_key(settings: PromptSetSettings, benchmarks: Mapping[str, Sequence[str]]) -> str:
    material = {
        "version": PROMPT_SET_VERSION,
        "settings": asdict(settings),
        "packages": {name: _version(name) for name in ("evals", "reasoning-gym", *PACKAGE_SOURCES)},
        "python": sys.version,
        "benchmarks": _benchmark_fingerprint(benchmarks),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def _to_json(prompt_set: PromptSet) -> bytes:
    data = {
        "version": PROMPT_SET_VERSION,
        "settings": asdict(prompt_set.settings),
        "prompts": [[p.id, prompt_set.source_of[p.id], p.source, p.messages, p.id in prompt_set.dev_ids]
                    for p in prompt_set.prompts],
        "read": prompt_set.stats.read,
        "skipped": dict(prompt_set.stats.skipped_by_reason),
        "first_example": prompt_set.stats.first_example,
        "overlaps": [[source, benchmark, count] for (source, benchmark), count in sorted(prompt_set.overlaps.items())],
        "seconds": prompt_set.seconds,
    }
    return gzip.compress(json.dumps(data, ensure_ascii=False).encode("utf-8"), compresslevel=1)


def _from_json(raw: bytes, cache_file: Path) -> PromptSet:
    data = json.loads(gzip.decompress(raw))
    prompts = [Prompt(id, messages, where) for id, _, where, messages, _ in data["prompts"]]
    stats = RowStats(data["read"], Counter(data["skipped"]), dict(data["first_example"]))
    return PromptSet(
        prompts, {row[0]: row[1] for row in data["prompts"]}, {row[0] for row in data["prompts"] if row[4]}, stats,
        Counter({(source, benchmark): count for source, benchmark, count in data["overlaps"]}),
        PromptSetSettings(**data["settings"]), cache_file=cache_file, from_cache=True,
    )


def _task(prompt: Prompt) -> str:
    return prompt.id.split("/")[1]  # evals/<task>/...


def _round_robin(prompts: list[Prompt], rng: random.Random) -> list[Prompt]:
    """One prompt of each task per round (each task's prompts and each round in random order)."""
    by_task: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_task.setdefault(_task(prompt), []).append(prompt)
    for task in sorted(by_task):
        rng.shuffle(by_task[task])
    ordered: list[Prompt] = []
    for round_index in range(max(map(len, by_task.values()), default=0)):
        this_round = [by_task[t][round_index] for t in sorted(by_task) if round_index < len(by_task[t])]
        rng.shuffle(this_round)
        ordered += this_round
    return ordered


def spread(streams: list[list[Prompt]]) -> list[Prompt]:
    """The streams merged so that any prefix holds the same fraction of each."""
    keyed = [((k + 0.5) / len(stream), i, k) for i, stream in enumerate(streams) for k in range(len(stream))]
    return [streams[i][k] for _, i, k in sorted(keyed)]


class _RegistryProgress:
    """The registry's progress: a line once worker processes have judged its rows (they report
    only at the end), then a bar over its tasks as they are taken."""

    def __init__(self, log: TextIO) -> None:
        self.log = log
        self.started = time.monotonic()
        self.bar: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            print(f"evals registry: rows judged in {time.monotonic() - self.started:.1f} s "
                  f"({default_workers()} worker processes)", file=self.log, flush=True)
            self.bar = Progress(total, "evals registry tasks", stream=self.log)
        self.bar.update(done - self.bar.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


CODE_SOURCES: tuple[tuple[str, Callable[[], list[Prompt]]], ...] = (
    ("python-stdlib", stdlib_prompts),
    ("python-packages", package_prompts),
    ("reasoning-gym", codeio_prompts),
)


def _decontaminated(prompts: list[Prompt], decontaminator: Decontaminator, keys: dict[str, str],
                    source_of: dict[str, str], stats: RowStats, overlaps: Counter) -> list[Prompt]:
    """`prompts` without those overlapping a benchmark, which are counted (by source and benchmark)
    and forgotten. `keys`: each prompt's normalised text, by id."""
    kept = []
    for prompt in prompts:
        hit = decontaminator.match_words(keys[prompt.id].split())
        if hit is None:
            kept.append(prompt)
            continue
        overlaps[source_of.pop(prompt.id), hit.benchmark] += 1
        stats.skip(OVERLAP, f"{prompt.id}: {hit.kind} with {hit.benchmark}: {hit.words[:120]!r}")
    return kept


def build_prompt_set(
    benchmarks: Mapping[str, Sequence[str]],
    settings: PromptSetSettings = PromptSetSettings(),
    *,
    cache_dir: str | Path | None = None,
    registry_dir: str | Path | None = None,
    code_sources: Sequence[tuple[str, Callable[[], list[Prompt]]]] = CODE_SOURCES,
    log: TextIO | None = None,
) -> PromptSet:
    """The default prompt set, decontaminated against `benchmarks` (name -> prompt texts).

    With `cache_dir`, a set built before with the same key is read back instead (and a new one
    is written there). `registry_dir` and `code_sources` replace the installed evals registry and
    the coding prompt sources (tests; the cache key does not see them, so tests pass no cache_dir
    with them)."""
    settings.validate()
    log = log or sys.stderr
    started = time.monotonic()
    cache_file = None
    if cache_dir is not None:
        cache_file = Path(cache_dir) / "prompts" / f"default-{cache_key(settings, benchmarks)}.json.gz"
        if cache_file.is_file():
            try:
                prompt_set = _from_json(cache_file.read_bytes(), cache_file)
            except (OSError, ValueError, KeyError, TypeError, EOFError) as error:
                print(f"note: ignoring the unreadable prompt cache {cache_file} ({error}); building again", file=log)
            else:
                prompt_set.seconds = time.monotonic() - started
                return prompt_set
    print("building the default prompt set from the evals registry, Python source and reasoning-gym "
          f"(about 70 s of one core's work, spread over {default_workers()} processes; once: it is cached)", file=log, flush=True)
    stats = RowStats()
    seen: set[str] = set()
    progress = _RegistryProgress(log)
    registry = capped_registry_prompts(
        seen, stats, seed=settings.seed, max_per_file=settings.max_per_file,
        max_short_per_file=settings.max_short_per_file, max_per_task=settings.max_per_task, registry_dir=registry_dir,
        on_task=progress,
    )
    progress.close()
    source_of = {p.id: "evals" for p in registry.open} | {p.id: "evals-short-answer" for p in registry.short_answer}
    keys = registry.keys  # each prompt's normalised text, worked out once: dedup, overlaps and the dev split read it
    code = []
    for source, read in code_sources:
        source_started = time.monotonic()
        prompts = read()
        print(f"{source}: {len(prompts)} prompts ({time.monotonic() - source_started:.1f} s)", file=log, flush=True)
        stats.count_read(len(prompts))
        for prompt in prompts:
            key = normalized_key(prompt_text(prompt))
            if key in seen:
                stats.skip("duplicate prompt", prompt.id)
                continue
            seen.add(key)
            keys[prompt.id] = key
            source_of[prompt.id] = source
            code.append(prompt)
    decontaminator = Decontaminator(benchmarks)
    overlaps: Counter = Counter()
    open_part = _decontaminated(registry.open + code, decontaminator, keys, source_of, stats, overlaps)
    short_part = _decontaminated(registry.short_answer, decontaminator, keys, source_of, stats, overlaps)
    rng = random.Random(f"{settings.seed}:order")
    streams = [_round_robin([p for p in open_part if source_of[p.id] == "evals"], rng)]
    for source, _ in code_sources:
        streams.append([p for p in open_part if source_of[p.id] == source])
        rng.shuffle(streams[-1])
    prompts = spread(streams) + _round_robin(short_part, rng)
    dev_ids = {p.id for p in prompts if key_in_dev_split(keys[p.id])}
    prompt_set = PromptSet(prompts, source_of, dev_ids, stats, overlaps, settings, cache_file=cache_file)
    prompt_set.seconds = time.monotonic() - started
    if cache_file is not None:
        write_bytes_atomic(cache_file, _to_json(prompt_set), mode=0o644)
    return prompt_set

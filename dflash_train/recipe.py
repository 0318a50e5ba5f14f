"""Recipes: what `dflash-train pipeline` does to a target, as a TOML file.

A recipe names every setting of every stage (prompts, self-prompts, regenerate, features,
train, eval, export); the built-in ones are package data (`dflash_train/recipes/NAME.toml`),
and any other file of the same shape is a recipe too. Every key is checked here, before any
model loads: an unknown key, a key in the wrong table and a value of the wrong type are errors
naming the file and the key. `[train]` takes `dflash-train train`'s keys (flat, or in its own
sections) except the ones the pipeline sets itself.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

from .config import (
    DECODERS,
    DTYPE_NAMES,
    ConfigError,
    TrainConfig,
    canonical_dtype,
    check_numbers,
    convert_values,
    load_file,
    option,
    unknown_key_error,
)

# `[train]` keys the pipeline fills in (the target, the answers it wrote, its own folders).
TRAIN_KEYS_SET_BY_PIPELINE = ("target", "data", "features", "out", "resume", "device")


@dataclasses.dataclass
class PromptsSection:
    source: str = option("default", "'default' (the built-in prompt set) or a prompts file; its train split is "
                                    "answered (a file's rows outside the 1-in-100 dev split of `dflash-train prompts`)")
    count: int = option(0, "prompts answered, self-written ones included (0 = every prompt of the source)", at_least=0)
    seed: int = option(0, "picks and orders the default prompts", at_least=0)

    def validate(self) -> None:
        check_numbers(self, "prompts")
        if not self.source:
            raise ConfigError("[prompts] source: 'default' or a prompts file")


@dataclasses.dataclass
class SelfPromptsSection:
    count: int = option(0, "of [prompts] count, this many are requests the target writes itself (0 = none)", at_least=0)
    max_new_tokens: int = option(128, "length cap of a self-written request (a request cut by it is dropped)", at_least=1)
    seed: int = option(0, "sampling seed of the requests", at_least=0)

    def validate(self) -> None:
        check_numbers(self, "self_prompts")


@dataclasses.dataclass
class RegenerateSection:
    max_new_tokens: int = option(1024, "answer length cap", at_least=1)
    max_prompt_tokens: int = option(0, "skip longer prompts (0 = the target's context minus max_new_tokens)", at_least=0)
    batch_size: int = option(0, "prompts decoded at once (0 = the device's default)", at_least=0)
    temperature: float = option(0.0, "0 = greedy", at_least=0)
    dtype: str = option("auto", "target weights while answering")

    def validate(self) -> None:
        check_numbers(self, "regenerate")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ConfigError(f"[regenerate] dtype {self.dtype!r}: use auto, {', '.join(DTYPE_NAMES)}")


@dataclasses.dataclass
class FeaturesSection:
    cache: bool = option(False, "store the target's hidden states once and train from them (worth it on a CPU)")
    dtype: str = option("bfloat16", "dtype of the stored features")

    def validate(self) -> None:
        self.dtype = canonical_dtype(self.dtype, "[features] dtype")


@dataclasses.dataclass
class EvalSection:
    bench: list[str] = option(["humaneval", "mtbench"], "benchmarks, 'dev' (the source's held-out split), "
                                                        "'mtbench_odd' (first turns of every other MT-Bench question) or files")
    limit: int = option(0, "the first N prompts of each (0 = all)", at_least=0)
    max_new_tokens: int = option(256, "new tokens per prompt", at_least=1)
    decoder: str = option("auto", "auto, static or hf")
    baseline: bool = option(True, "also decode target-only: the speed-up (else only tau)")

    def validate(self) -> None:
        if not self.bench:
            raise ConfigError("[eval] bench is empty")
        check_numbers(self, "eval")
        if self.decoder not in DECODERS:
            raise ConfigError(f"[eval] decoder {self.decoder!r}: use {', '.join(DECODERS)}")


@dataclasses.dataclass
class SpeedSection:
    bench: list[str] = option([], "benchmarks of the speed-up run, in one process with the target-only baseline "
                                  "(empty = the speed-up of [eval], which needs baseline = true)")
    limit: int = option(0, "the first N prompts of each (0 = all)", at_least=0)
    decoder: str = option("static", "auto, static or hf")

    def validate(self) -> None:
        check_numbers(self, "speed")
        if self.decoder not in DECODERS:
            raise ConfigError(f"[speed] decoder {self.decoder!r}: use {', '.join(DECODERS)}")


@dataclasses.dataclass
class ExportSection:
    dtype: str = option("bfloat16", "weight dtype of the drafter folder engines load")

    def validate(self) -> None:
        self.dtype = canonical_dtype(self.dtype, "[export] dtype")


SECTIONS: dict[str, type] = {
    "prompts": PromptsSection, "self_prompts": SelfPromptsSection, "regenerate": RegenerateSection,
    "features": FeaturesSection, "eval": EvalSection, "speed": SpeedSection, "export": ExportSection,
}
TOP_KEYS = ("description", "measured")


@dataclasses.dataclass
class Recipe:
    name: str
    description: str
    measured: str  # what it gave where it was measured, or why it was not
    prompts: PromptsSection
    self_prompts: SelfPromptsSection
    regenerate: RegenerateSection
    features: FeaturesSection
    train: dict[str, Any]  # `dflash-train train` settings by flat name (typed), without the pipeline's own
    eval: EvalSection
    speed: SpeedSection
    export: ExportSection

    def train_config(self, target: str, data: str, out: str, *, features: str = "", device: str = "auto") -> TrainConfig:
        """The `train` settings of this recipe for the given files (made, and so checked, like
        the flags of `dflash-train train`)."""
        try:
            return TrainConfig(**{**self.train, "target": target, "data": [] if features else [data], "out": out,
                                  "features": features, "resume": True, "device": device})
        except ConfigError as error:
            raise ConfigError(f"recipe {self.name}: [train] {error}") from None

    @property
    def titled(self) -> str:
        """Its name, with its description where it has one."""
        return f"{self.name} ({self.description})" if self.description else self.name

    def section_values(self, section: str) -> dict[str, Any]:
        """One table's values, as the stage record keeps them."""
        value = getattr(self, section)
        return dict(value) if isinstance(value, dict) else dataclasses.asdict(value)


def builtin_recipes() -> list[str]:
    folder = resources.files("dflash_train") / "recipes"
    return sorted(entry.name.removesuffix(".toml") for entry in folder.iterdir() if entry.name.endswith(".toml"))


def recipe_path(name_or_file: str) -> Path:
    """A built-in recipe's file by name, or the file given."""
    if name_or_file.endswith(".toml") or "/" in name_or_file:
        path = Path(name_or_file)
        if not path.is_file():
            raise ConfigError(f"--recipe {name_or_file}: no such file")
        return path
    if name_or_file not in builtin_recipes():
        raise ConfigError(f"--recipe {name_or_file!r}: not a built-in recipe ({', '.join(builtin_recipes())}) "
                          "nor a .toml file")
    return Path(str(resources.files("dflash_train") / "recipes" / f"{name_or_file}.toml"))


def load_recipe(name_or_file: str, overrides: dict[str, dict[str, Any]] | None = None) -> Recipe:
    """The recipe, every key checked; `overrides` (table -> key -> value) replace its values
    (a command's own flags, e.g. `quickstart --steps`) and are checked the same way."""
    path = recipe_path(name_or_file)
    raw = load_file(path)
    for table, values in (overrides or {}).items():
        raw.setdefault(table, {}).update(values)
    name = path.stem if path.parent.name == "recipes" and not name_or_file.endswith(".toml") else str(path)
    return recipe_from_dict(raw, name)


def recipe_from_dict(raw: dict[str, Any], name: str) -> Recipe:
    where = f"recipe {name}"
    sections: dict[str, Any] = {}
    for key, value in raw.items():
        if key in TOP_KEYS:
            if not isinstance(value, str):
                raise ConfigError(f"{where}: {key} must be a string")
            continue
        if key not in (*SECTIONS, "train"):
            raise unknown_key_error(key, [*TOP_KEYS, *SECTIONS, "train"], where)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: [{key}] must be a table, got {value!r}")
    for key, cls in SECTIONS.items():
        section = cls(**convert_values(cls, raw.get(key, {}), f"{where}: [{key}]"))
        try:
            section.validate()
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
        sections[key] = section
    train = convert_values(TrainConfig, raw.get("train", {}), f"{where}: [train]")
    owned = [key for key in TRAIN_KEYS_SET_BY_PIPELINE if key in train]
    if owned:
        raise ConfigError(f"{where}: [train] {owned[0]}: set by the pipeline itself (remove it from the recipe)")
    if train.get("mode", "replicas") != "replicas":
        raise ConfigError(f"{where}: [train] mode {train['mode']!r}: the pipeline trains one drafter (replicas); "
                          "train variants with `dflash-train train`")
    if train.get("export_dtype", "bfloat16") == "":
        raise ConfigError(f"{where}: [train] export_dtype is empty: the eval stage reads the training's export")
    recipe = Recipe(name=name, description=raw.get("description", ""), measured=raw.get("measured", ""),
                    train=train, **sections)
    recipe.train_config("target", "data.jsonl", "run")  # every [train] value checked now
    prompts, own = recipe.prompts, recipe.self_prompts
    if own.count and prompts.count and own.count > prompts.count:
        raise ConfigError(f"{where}: [self_prompts] count {own.count} is more than [prompts] count {prompts.count}")
    if own.count and not prompts.count:
        raise ConfigError(f"{where}: [self_prompts] count needs a [prompts] count (the self-written requests take "
                          "the place of the source's last prompts)")
    if not recipe.speed.bench and not recipe.eval.baseline:
        raise ConfigError(f"{where}: no speed-up is measured: set [eval] baseline = true or a [speed] bench")
    return recipe

"""The benchmark overlap filter, against the real built-in benchmark prompts."""

import random

import pytest

from dflash_train.commands._common import benchmark_prompt_texts
from dflash_train.data.decontaminate import NGRAM, Decontaminator, normalized_key, normalized_words


@pytest.fixture(scope="module")
def benchmarks():
    return benchmark_prompt_texts()


@pytest.fixture(scope="module")
def decontaminator(benchmarks):
    return Decontaminator(benchmarks)


FILLER = ("Our quarterly garden club newsletter covers compost, tomatoes, volunteer schedules and the autumn bulb "
          "sale; members should bring gloves and a thermos because the greenhouse heating is still broken").split()


def test_every_builtin_benchmark_is_covered(benchmarks, decontaminator):
    assert set(benchmarks) == {"humaneval", "mtbench", "math500", "aime", "ifbench"}
    assert all(len(texts) >= 30 for texts in benchmarks.values())
    assert decontaminator.prompts == sum(len(t) for t in benchmarks.values())


def test_normalisation_ignores_case_whitespace_and_punctuation():
    assert normalized_words("def has_close_elements(numbers: List[float]) -> bool:") == \
        ["def", "has", "close", "elements", "numbers", "list", "float", "bool"]
    assert normalized_key("Hello,   WORLD!\n\t(again)") == normalized_key("hello world again")
    assert normalized_words("Größe ändern: 東京") == ["größe", "ändern", "東京"]


def test_planted_exact_copy_is_dropped(benchmarks, decontaminator):
    original = benchmarks["humaneval"][7]
    # Same words, other spacing, case and punctuation: still the benchmark prompt.
    planted = "  " + original.upper().replace("\n", "  \n ").replace(":", " ; ") + " !!"
    hit = decontaminator.match(planted)
    assert hit is not None and hit.benchmark == "humaneval" and hit.kind == "exact"


def test_planted_paraphrase_sharing_a_13_gram_is_dropped(benchmarks, decontaminator):
    words = normalized_words(benchmarks["mtbench"][3])
    shared = words[5:5 + NGRAM]
    planted = "Here is a task I found somewhere: " + " ".join(shared).upper() + ", and then rewrite it as a limerick."
    hit = decontaminator.match(planted)
    assert hit is not None and hit.benchmark == "mtbench" and hit.kind == f"{NGRAM}-gram"
    assert hit.words == " ".join(shared)


def test_near_miss_sharing_only_12_words_is_kept(benchmarks, decontaminator):
    words = normalized_words(benchmarks["mtbench"][3])
    near = " ".join(words[5:5 + NGRAM - 1])
    assert decontaminator.match(f"Here is a task I found somewhere: {near}, and then rewrite it as a limerick.") is None
    # ... also when the 13th word is there but changed.
    assert decontaminator.match(f"{near} zebrafish {' '.join(words[5 + NGRAM:5 + 2 * NGRAM - 2])}") is None


@pytest.mark.parametrize("name", ["humaneval", "mtbench", "math500", "aime", "ifbench"])
def test_a_13_gram_is_found_at_every_offset(benchmarks, decontaminator, name):
    """The anchor shortcut (7-grams at multiples of 7) must not miss a 13-gram wherever it sits."""
    rng = random.Random(name)
    texts = [t for t in benchmarks[name] if len(normalized_words(t)) >= NGRAM + 10]
    for offset in range(0, 15):
        words = normalized_words(rng.choice(texts))
        start = rng.randrange(len(words) - NGRAM + 1)
        planted = FILLER[:offset] + words[start:start + NGRAM] + FILLER[offset:offset + 5]
        hit = decontaminator.match(" ".join(planted))
        assert hit is not None and hit.kind == f"{NGRAM}-gram", (offset, start)


def test_clean_text_and_short_benchmarks():
    decontaminator = Decontaminator({"tiny": ["Name three primes."], "long": [" ".join(FILLER)]})
    assert decontaminator.match(" ".join(FILLER[:NGRAM - 1])) is None
    assert decontaminator.match("name THREE primes") is not None  # a short benchmark prompt matches exactly ...
    assert decontaminator.match("Name three primes and explain why they are prime.") is None  # ... only
    assert decontaminator.match("") is None

"""The data files tests read: those in tests/data, and the bar recipe's 4,000 answers, which the
repository does not ship (its tests read `$DFLASH_REGENERATED_4000` and skip without it)."""

import os
from pathlib import Path

DATA = Path(__file__).parent / "data"
REGENERATED_64 = DATA / "smollm2_regenerated_64.jsonl.gz"  # the first 64 rows of the 4,000 below
REGENERATED_4000 = Path(os.environ.get("DFLASH_REGENERATED_4000", "smollm2-regenerated-4000.jsonl.gz"))
WITHOUT_REGENERATED_4000 = f"{REGENERATED_4000} is not here: set $DFLASH_REGENERATED_4000 to the bar recipe's data"

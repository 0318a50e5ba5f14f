"""One module per CLI command: its config dataclass, its run function, its output.

Command modules import torch and transformers inside their run functions only, so `cli.py` can
build a command's flags (`dflash-train train --help`) without loading either."""

"""``python -m stemlm.train ...`` = ``stemlm train ...``."""

import sys

from ..cli import main

sys.exit(main(["train", *sys.argv[1:]]))

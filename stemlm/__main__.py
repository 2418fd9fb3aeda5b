"""``python -m stemlm`` = the ``stemlm`` command."""

import sys

from .cli import main

sys.exit(main())

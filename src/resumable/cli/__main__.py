"""``python -m resumable.cli``: the ``resumable`` command."""

import sys

from resumable.cli import main

sys.exit(main())

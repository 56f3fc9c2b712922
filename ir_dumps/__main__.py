"""``python -m ir_dumps``: see :mod:`ir_dumps.cli`."""
import sys

from ir_dumps.cli import main

sys.exit(main())

"""``python -m aiokv`` is the ``aiokv`` command."""

import sys

from aiokv.cli import main

if __name__ == "__main__":
    sys.exit(main())

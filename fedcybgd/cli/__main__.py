"""``python -m fedcybgd.cli``: the ``fedcybgd`` command."""

import sys

from fedcybgd.cli import main

sys.exit(main())

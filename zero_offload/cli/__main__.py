"""``python -m zero_offload.cli``: the ``zero-offload`` command."""

import sys

from . import main

sys.exit(main())

"""``python -m zero_offload.bench.interrupts``: the campaign from a shell."""

import sys

from .campaign import main

sys.exit(main())

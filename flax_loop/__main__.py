r"""`python -m flax_loop ls|verify|show ...`: the checkpoint inspector (`flax_loop.output.cli`)."""

import sys

from flax_loop.output.cli import main

sys.exit(main())

"""``python -m rollout_bus``: the same as the ``rollout-bus`` command."""

import sys

from rollout_bus.cli import main

sys.exit(main())

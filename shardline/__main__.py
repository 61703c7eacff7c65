"""``python -m shardline``: the same as the ``shardline`` command."""

import sys

from shardline.cli import main

sys.exit(main())

"""``python -m plexd``: the installed package's command line (a restart runs `plexd up` this way)."""

import sys

from plexd.cli import main

sys.exit(main())

"""``python -m gradsync_core`` runs the ``gradsync`` command line."""

import sys

from gradsync_core.cli import main

sys.exit(main())

"""``python -m gradsync_core`` runs the ``gradsync`` command line."""

import sys

from gradsync_core._cli import main

sys.exit(main())

"""``python -m fedcluster``: the command line (:func:`fedcluster.cli.main`)."""

import sys

from fedcluster.cli import main

sys.exit(main())

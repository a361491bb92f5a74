"""``python -m proxy.cli``: the same as the ``egresswall`` command."""

import sys

from . import main

sys.exit(main())

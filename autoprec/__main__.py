"""``python -m autoprec`` is the ``autoprec`` command."""

import sys

from autoprec.cli import main

sys.exit(main())

"""`python -m autopar.bench`: the same as `python -m autopar bench`."""

import sys

from autopar.bench.compare import main

sys.exit(main())

import sys

from autopar.cli import main

if __name__ == "__main__":  # imported (not run) when pytest collects the package's doctests
    sys.exit(main())

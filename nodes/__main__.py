"""`python -m nodes --role ...` is `specbus node --role ...`."""

import sys

from nodes.cli import main

if __name__ == "__main__":
    sys.exit(main(["node", *sys.argv[1:]]))

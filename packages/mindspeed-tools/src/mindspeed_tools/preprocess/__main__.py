"""`python -m mindspeed_tools.preprocess`: the same as `mindspeed preprocess`."""

import sys

from mindspeed_core.cli import debug_enabled, guarded
from mindspeed_tools.preprocess import main

if __name__ == "__main__":
    sys.exit(guarded(main, sys.argv[1:], debug=debug_enabled(sys.argv)))

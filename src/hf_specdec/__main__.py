"""``python -m hf_specdec ...``: the ``hf-specdec`` command (also under ``accelerate launch -m hf_specdec``)."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())

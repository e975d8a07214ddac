"""``python -m lightning_smp.checkpoint consolidate SRC DST``."""

import sys

from lightning_smp.checkpoint.convert import main

sys.exit(main())

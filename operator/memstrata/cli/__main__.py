"""`python -m memstrata.cli`: the same as the `memstrata` console script."""
import sys

from memstrata.cli import main

sys.exit(main())

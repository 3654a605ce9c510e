import sys

from hf_domino.cli import main

sys.exit(main())

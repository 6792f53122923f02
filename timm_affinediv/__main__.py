"""`python -m timm_affinediv COMMAND ...`: the `timm-affinediv` command."""
import sys

from .cli import main

sys.exit(main())

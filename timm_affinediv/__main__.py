"""`python -m timm_affinediv COMMAND ...`: the `timm-affinediv` command."""
import sys

from .commands import main

sys.exit(main())

"""In a child process an example starts (`torchrun`, a command with an environment assignment): the same stand-ins
as the test process (`tests/examples.py`), when `TIMM_AFFINEDIV_EXAMPLE_STANDINS` is set; nothing otherwise, and
nothing in torchrun's launcher, which builds no model and reads no data (its workers apply them)."""
import os
import sys

if os.environ.get('TIMM_AFFINEDIV_EXAMPLE_STANDINS') and sys.orig_argv[1:3] != ['-m', 'torch.distributed.run']:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import examples

    examples.apply_in_child()

"""Train an SE-ResNeXt on LMDB data with DDP: ``ddpkit.examples.seresnext_lmdb``, run as a file.

The code ships in the package, so ``python -m ddpkit.examples.seresnext_lmdb``
does the same from any directory once ddpkit is installed; this file runs it
from a checkout (``python examples/seresnext_lmdb.py --demo``, ``torchrun ...
examples/seresnext_lmdb.py --data DIR``). ``--help`` lists the flags.
"""

from ddpkit.examples.seresnext_lmdb import main

if __name__ == "__main__":
    main()

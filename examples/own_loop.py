"""The seed recipe's loop written by hand with ddpkit: ``ddpkit.examples.own_loop``, run as a file.

The code ships in the package, so ``python -m ddpkit.examples.own_loop`` does
the same from any directory once ddpkit is installed; this file runs it from a
checkout (``python examples/own_loop.py --data DIR --nproc-per-node 2``).
``--help`` lists the flags; docs/own-loop.md walks through it.
"""

from ddpkit.examples.own_loop import main

if __name__ == "__main__":
    main()

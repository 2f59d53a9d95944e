"""``python -m zbench.worker WORKDIR``: what every rank of a case runs.

Note: this module name is a contract across versions (``zbench ab`` starts a
base checkout's ranks with head's launcher and the other way round), so it
stays here while the code lives in :mod:`zbench.rank.worker`.
"""

import sys

from zbench.rank.worker import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

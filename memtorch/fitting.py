"""fit(): moved to memtorch.estimator.fit. This name stays for code that imports
it: it is that module (the same object), not a copy."""

import sys

from .estimator import fit as _moved

sys.modules[__name__] = _moved

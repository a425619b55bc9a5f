"""estimate() and its dry run: moved to memtorch.estimator.estimate. This name stays for code that imports
it: it is that module (the same object), not a copy."""

import sys

from .estimator import estimate as _moved

sys.modules[__name__] = _moved

"""The meta-test of the leak suites: every function of memtorch._C is looped by one of them
(psutil's test_memleaks.py idea), and module.c's own _set_types is looped here."""

import sys

import torch

from memtorch import _C, _torch

import test_alloc_model
import test_marks
import test_names_walk
import test_refleaks_counters
import test_refleaks_walker


def _c_functions():
    return sorted(n for n in dir(_C) if not n.startswith("__") and callable(getattr(_C, n)))


def test_every_c_function_is_in_a_leak_suite():
    covered = set(test_refleaks_walker.WALKER_FUNCTIONS) | {"_set_types"}
    covered |= set(test_refleaks_counters._counters_functions())
    covered |= test_names_walk.NAMES_FUNCTIONS
    covered |= test_marks.MARKS_FUNCTIONS
    covered |= test_alloc_model.ALLOC_FUNCTIONS
    missing = [n for n in _c_functions() if n not in covered]
    assert missing == [], f"_C functions no leak loop exercises: {missing}"


def test_set_types_does_not_leak():
    _torch.torch()
    types = (torch.Tensor, torch.nn.Parameter, torch.nn.Module, torch.optim.Optimizer)
    refs0 = [sys.getrefcount(t) for t in types]

    def bad():
        try:
            _C._set_types(1, 2, 3, 4)
        except TypeError:
            pass

    deltas = []
    for i in range(6):
        before = sys.getallocatedblocks()
        for _ in range(200):
            _C._set_types(*types)
            bad()
        if i >= 2:
            deltas.append(sys.getallocatedblocks() - before)
    assert not all(d > 0 for d in deltas), deltas
    assert [sys.getrefcount(t) for t in types] == refs0

"""ModelMemory's first home: the names stay importable here (memtorch.report.ModelMemory, pickles).

The type lives in memtorch/reports/model.py with the other result types.
"""

from .reports.model import CATEGORIES, MODULE_RULE, ModelMemory, ModuleRow

__all__ = ["ModelMemory", "ModuleRow", "CATEGORIES", "MODULE_RULE"]

"""TransformerEngine's recipe module for the scripts that write TE's ``_extra_state``
(tests/readers/test_te_extra_state.py,
bench/make_allowlist.py): the pip package without its compiled core refuses to import, so the recipe module
(transformer_engine/common/recipe/__init__.py, which needs only pydantic) is loaded from TE's own source under its
real module path."""

from __future__ import annotations

# Python source run at the top of such a script, once ``root`` names the ``transformer_engine`` folder; defines
# ``recipe``.
LOAD_TE_RECIPE = """
import importlib.util, sys, types
for name, path in (("transformer_engine", root), ("transformer_engine.common", root + "/common")):
    package = types.ModuleType(name)  # TE's package __init__ loads its compiled core: only the recipe is needed
    package.__path__ = [path]
    sys.modules[name] = package
spec = importlib.util.spec_from_file_location("transformer_engine.common.recipe", root + "/common/recipe/__init__.py")
recipe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = recipe
spec.loader.exec_module(recipe)
"""

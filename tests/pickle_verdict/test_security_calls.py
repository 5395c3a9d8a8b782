"""A class is code (issue 22, item 1): a call is admitted only for a reviewed entry that real stacks use.

Calling a class runs its ``__new__``/``__init__``: classes of torch and numpy that create files, start processes or
``exec`` and ``eval`` an argument are each called here by a payload that is live under ``torch.load(weights_only=
False)`` (proved in a subprocess), and each is a CKD601 error when it is the ``training_args.bin`` of an otherwise
complete Trainer checkpoint. The review of the entries admitted for calls is docs/security.md ("Calls"); the tests
below hold it to ``pickle_policy.REVIEWED_CALLS`` and ``CALLED_ENUMS`` and to the calls real files make.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
from pathlib import Path

import pytest

from bench import make_allowlist
from ckptdoctor.model import GlobalRef
from ckptdoctor.pickle_verdict import policy as pickle_policy
from ckptdoctor.pickle_verdict.judge import judge
from ckptdoctor.pickle_verdict.policy import CALLED_ENUMS, REBUILD_HOOKS, REVIEWED_CALLS, is_dangerous
from ckptdoctor.readers.pickle_walk import BYTES_LOADER, walk_pickle
from ckptdoctor.scanner import scan
from tests.helpers import payloads
from tests.helpers.builders import make_checkpoint
from tests.helpers.paths import REPO

torch = pytest.importorskip("torch")

ROOT = REPO

_LOAD = r"""
import io, json, sys, time
import torch
for item in json.load(sys.stdin):
    try:
        torch.load(item["path"], weights_only=False)
    except BaseException:
        pass  # the call ran before whatever failed after it
time.sleep(0.5)  # a started process creates its canary on its own time
"""


_TE_LAYER = Path("/work/stacks/te/transformer_engine")  # pip install --no-deps --target /work/stacks/te ...


@pytest.fixture
def te_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """TransformerEngine's recipe module under its real name, from TE's own source in the layer when it is there (the
    pip package without its compiled core refuses to import; the recipe module needs only pydantic)."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    init = _TE_LAYER / "common" / "recipe" / "__init__.py"
    if not init.is_file() or importlib.util.find_spec("pydantic") is None:
        return
    for name, path in (("transformer_engine", _TE_LAYER), ("transformer_engine.common", _TE_LAYER / "common")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        monkeypatch.setitem(sys.modules, name, package)
    spec = importlib.util.spec_from_file_location("transformer_engine.common.recipe", init)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)


pytestmark = pytest.mark.usefixtures("fresh_policy_caches")  # tests/pickle_verdict/conftest.py


def test_every_class_call_payload_is_live(tmp_path: Path) -> None:
    assert payloads.dead(payloads.class_call_payloads, tmp_path, _LOAD) == []


def test_each_class_call_is_ckd601_in_a_complete_trainer_checkpoint(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    placed = {}
    for p in payloads.class_call_payloads(canary):
        ck = make_checkpoint(tmp_path / "runs" / payloads.slug(p.name) / "checkpoint-4")
        (ck / p.filename).write_bytes(p.data)
        placed[f"{payloads.slug(p.name)}/checkpoint-4/{p.filename}"] = p
    report = scan(str(tmp_path / "runs"))
    assert payloads.missed(report.findings, placed) == []
    assert not canary.exists()
    # the checkpoints are otherwise complete: nothing else of them is a security finding
    assert all(f.path in placed for f in report.findings if f.rule.startswith("CKD6"))


def _verdict(data: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    facts, problems, _ = walk_pickle(data)
    assert facts is not None and not problems
    v = judge(facts)
    return v.unsafe, v.unknown


def test_a_proved_class_is_admitted_when_named_or_rebuilt_without_arguments() -> None:
    g = b"ctransformers.generation.configuration_utils\nGenerationConfig\n"  # no hook, proved by its source
    other = b"ctorch.optim.adamw\nAdamW\n"  # not in the allowlist: proved a class of torch by its source
    assert _verdict(b"\x80\x02" + other + b".") == ((), ())
    assert _verdict(b"\x80\x02" + g + b")\x81}X\x01\x00\x00\x00aK\x01sb.") == ((), ())
    # the same class called with an argument, or filled by SETITEM (its __setitem__), is code
    assert _verdict(b"\x80\x02" + g + b"(K\x01tR.")[0]
    assert _verdict(b"\x80\x02" + other + b")\x81X\x01\x00\x00\x00aK\x01s.")[0]


def test_a_rebuild_of_a_proved_class_defining_setstate_is_an_error() -> None:
    # torch.nn.Module defines __setstate__: a BUILD of a Module rebuilt by NEWOBJ runs it
    unsafe, _ = _verdict(b"\x80\x02ctorch.nn.modules.module\nModule\n)\x81}b.")
    assert unsafe == ("`torch.nn.modules.module.Module`",)


@pytest.mark.parametrize(
    "dotted",
    ["torch.distributed.elastic.multiprocessing.api.SubprocessContext", "torch._inductor.codecache.subprocess.run",
     "somepkg.vendored.subprocess.Popen", "a.b.torch.hub.load"],
)  # fmt: skip
def test_a_dangerous_module_is_matched_at_any_depth(dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    assert is_dangerous(GlobalRef(module, name))


def test_real_stacks_call_only_reviewed_entries() -> None:
    """Every global the matrix's files call with arguments (``allowlist.json`` ``called``) is admitted for calls."""
    doc = json.loads((ROOT / "ckptdoctor" / "pickle_verdict" / "allowlist.json").read_text())
    called = doc["called"]
    assert called, "the allowlist records the calls real files make"
    # torch.storage._load_from_bytes is admitted only where its bytes were read and judged (docs: "Calls"); the same
    # function decides ``bench/make_allowlist.py --check``
    assert make_allowlist.unreviewed_calls(called) == []
    assert sorted(make_allowlist.CONDITIONAL_CALLS) == [BYTES_LOADER.dotted]


def test_the_review_in_docs_lists_every_entry_admitted_for_calls() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    review = text[text.index("## Calls") :]
    review = review[: review.index("\n## ", 4)]
    missing = [name for name in (*REVIEWED_CALLS, *CALLED_ENUMS, *REBUILD_HOOKS) if f"`{name}`" not in review]
    assert missing == []


_HOOKS = ("__new__", "__setstate__", "__getattr__", "__getattribute__", "__setattr__")


@pytest.mark.usefixtures("te_recipe")
def test_every_python_hook_a_rebuild_of_an_allowlist_entry_runs_is_reviewed() -> None:
    """A NEWOBJ of no arguments and a BUILD of an exact allowlist entry (admitted without looking at its source) run
    only hooks reviewed in ``REBUILD_HOOKS``, for every entry installed here (TRL, DeepSpeed and MindSpore are not)."""
    unreviewed = []
    for dotted in sorted(pickle_policy.ALLOWED | pickle_policy._allowlist()):
        module, _, name = dotted.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if not isinstance(cls, type) or issubclass(cls, enum.Enum):
            continue  # an enum is rebuilt by a value lookup, reviewed as a call
        for k in cls.__mro__:
            params = getattr(k, "__dataclass_params__", None)
            for h in _HOOKS:
                hook = vars(k).get(h)
                hook = getattr(hook, "__func__", hook)  # a staticmethod's function
                if not inspect.isfunction(hook):
                    continue  # written in C: given no argument, it makes an empty value
                if h == "__setattr__" and params is not None and params.frozen:
                    continue  # the generated frozen __setattr__ raises
                owner = f"{k.__module__}.{k.__qualname__}.{h}"
                if owner not in REBUILD_HOOKS:
                    unreviewed.append(f"{dotted}: {owner}")
    assert unreviewed == []


@pytest.mark.usefixtures("te_recipe")
def test_the_enums_admitted_for_calls_only_look_a_member_up() -> None:
    """``Cls(value)`` runs ``EnumType.__call__`` -> ``Enum.__new__`` (a lookup) -> ``_missing_``: each enum admitted
    for calls that is installed here uses the standard ones, or transformers' ``ExplicitEnum._missing_``."""
    allowed_missing = {enum.Enum._missing_.__func__}  # type: ignore[attr-defined]
    try:
        from transformers.utils.generic import ExplicitEnum

        allowed_missing.add(ExplicitEnum._missing_.__func__)  # type: ignore[attr-defined]
    except ImportError:
        pass
    checked = 0
    for dotted in sorted(CALLED_ENUMS):
        module, _, name = dotted.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError:
            assert dotted.startswith(("deepspeed.", "transformer_engine.")), dotted
            continue  # deepspeed is not installed here, nor TransformerEngine without its layer
        assert issubclass(cls, enum.Enum), dotted
        assert type(cls).__call__ is enum.EnumType.__call__, dotted
        assert cls.__new__ is enum.Enum.__new__, dotted
        assert cls._missing_.__func__ in allowed_missing, dotted
        checked += 1
    assert checked >= len(CALLED_ENUMS) - 2

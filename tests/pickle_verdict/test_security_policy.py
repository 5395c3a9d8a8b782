"""The pickle policy on real files from real stacks (never blocked) and on what must be blocked: wildcards gone,
functions denied by default, classes handed to calls in dict keys; the user's escape hatch and how it is reported;
and the soundness property: whenever the static verdict has no security finding, a real unpickler whose
``find_class`` records every global sees only names the policy allows.

tests/data/stacks/ holds ``training_args.bin`` files written by ``torch.save(args)`` (what ``Trainer._save``
does) under TRL 1.16 (transformers 5.24; ORPO from ``trl.experimental``), TRL 1.12 (PPOConfig, which 1.13 dropped)
and DeepSpeed 0.19.8 ZeRO-2/3 configs, made with bench/make_allowlist.py's stacks; TRL is not installed in the test
environment, so they pass on the stream's own facts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import pickle
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor import scan
from ckptdoctor.cli import main
from ckptdoctor.discover import discover
from ckptdoctor.findings import Severity
from ckptdoctor.limits import Limits
from ckptdoctor.model import GlobalRef
from ckptdoctor.pickle_verdict import policy as pickle_policy
from ckptdoctor.pickle_verdict.judge import Verdict, judge
from ckptdoctor.pickle_verdict.policy import Standing, standing
from ckptdoctor.readers.pickle_walk import walk_pickle
from ckptdoctor.rules import Selection, run_rules
from ckptdoctor.scanner import scan_tree
from tests.helpers.paths import TESTS

torch = pytest.importorskip("torch")

STACKS = TESTS / "data" / "stacks"
SECURITY = ("CKD601", "CKD602", "CKD603", "CKD605")


def _security(root: Path, **kw: object) -> list[str]:
    report = scan(str(root), no_config=True, **kw)  # type: ignore[arg-type]
    return [f"{f.rule} {f.path}: {f.message}" for f in report.findings if f.rule in SECURITY]


pytestmark = pytest.mark.usefixtures("fresh_policy_caches")  # tests/pickle_verdict/conftest.py


def test_real_trl_and_deepspeed_training_args_are_clean() -> None:
    assert importlib.util.find_spec("trl") is None, "TRL must not be installed here: the verdict comes from facts"
    files = sorted(p.name for p in STACKS.iterdir())
    # the seven configs the issue names: ORPO from trl.experimental in 1.16, PPO from 1.12, the last TRL that has it
    configs = ("SFTConfig", "DPOConfig", "GRPOConfig", "KTOConfig", "RewardConfig", "ORPOConfig")
    assert {f"trl-1.16-{c}.bin" for c in configs} | {"trl-1.12-PPOConfig.bin"} <= set(files)
    assert _security(STACKS) == []


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("trl-1.16-ORPOConfig.bin", "trl.experimental.orpo.orpo_config.ORPOConfig"),
        ("trl-1.12-PPOConfig.bin", "trl.experimental.ppo.ppo_config.PPOConfig"),
    ],
)
def test_experimental_trl_configs_are_training_arguments_data(
    name: str, cls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ORPOConfig and PPOConfig live in ``trl.experimental``: with no allowlist entry for TRL at all, the stream's
    own facts (NEWOBJ + BUILD of TrainingArguments' fields) admit them."""
    import zipfile

    monkeypatch.setattr(pickle_policy, "GENERATED", frozenset(g for g in pickle_policy.GENERATED if "trl" not in g))
    with zipfile.ZipFile(STACKS / name) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    facts, _, _ = walk_pickle(pkl, persistent_load=lambda pid: None)
    assert facts is not None and cls in {g.dotted for g in facts.calls}
    verdict = judge(facts)
    assert not verdict.unsafe and not verdict.unknown
    assert any(g == cls and "TrainingArguments data" in why for g, why in verdict.admitted)


def test_a_trl_config_is_admitted_by_the_stream_facts_not_a_name_list(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "trl.trainer.dpo_config.DPOConfig" in pickle_policy.GENERATED  # the matrix saw it
    # Without that entry (another TRL release, another TrainingArguments subclass) the stream's facts decide.
    monkeypatch.setattr(pickle_policy, "GENERATED", frozenset(g for g in pickle_policy.GENERATED if "trl" not in g))
    pickle_policy.standing.cache_clear()
    pickle_policy._settled.cache_clear()  # the allowlist's answers are cached too
    data = (STACKS / "trl-1.16-DPOConfig.bin").read_bytes()
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    facts, _, _ = walk_pickle(pkl, persistent_load=lambda pid: None)
    assert facts is not None
    dpo = GlobalRef("trl.trainer.dpo_config", "DPOConfig")
    assert standing(dpo)[0] is Standing.UNPROVEN  # no source, not in a hand list
    verdict = judge(facts)
    assert not verdict.unsafe and not verdict.unknown
    assert any(g == dpo.dotted and "TrainingArguments data" in why for g, why in verdict.admitted)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("transformers.integrations.deepspeed", "HfDeepSpeedConfig"),
        ("transformers.integrations.deepspeed", "HfTrainerDeepSpeedConfig"),
        ("transformers.training_args_seq2seq", "Seq2SeqTrainingArguments"),
        ("accelerate.utils.dataclasses", "GradientAccumulationPlugin"),
        ("accelerate.utils.dataclasses", "FullyShardedDataParallelPlugin"),
        ("peft.tuners.lora.config", "LoraConfig"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ],
)
def test_classes_of_installed_known_packages_are_proved_by_their_source(
    module: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source proof, for a class whose module a resuming process has imported. Where it has not, loading the
    file would import the module and run its top level, whatever the class defines: unproven, and the scan says
    which module (``test_a_class_whose_module_is_not_loaded_is_unproven``)."""
    monkeypatch.setattr(pickle_policy, "RESUME_MODULES", pickle_policy.resume_modules() | {module})
    assert standing(GlobalRef(module, name))[0] is Standing.ALLOWED


@pytest.mark.parametrize(
    "dotted",
    [
        "numpy.lib.tests.test_shape_base.TestApplyOverAxes",  # the s1-c74 counterexample: a numpy test module
        "torch._inductor.cpp_builder.CppOptions",
        "transformers.models.llama.modeling_llama.LlamaModel",
        "peft.tuners.lora.config.LoraConfig",  # a Lightning or bare DCP resume has not imported peft
    ],
)
def test_a_class_whose_module_is_not_loaded_is_unproven(dotted: str, tmp_path: Path) -> None:
    """Naming a class makes the unpickler import its module (``find_class``): a class proved plain by its source
    still runs its module's top level when a resuming process had not imported it. Only named (GLOBAL, then
    discarded), or rebuilt by a NEWOBJ of no arguments, it is an error that names the module."""
    module, _, name = dotted.rpartition(".")
    assert module not in pickle_policy.resume_modules()
    st, why = standing(GlobalRef(module, name))
    assert st is Standing.UNPROVEN and f"would import `{module}`" in why, why
    named = f"\x80\x02c{module}\n{name}\n0N.".encode("latin-1")
    rebuilt = f"\x80\x02c{module}\n{name}\n)\x81}}b.".encode("latin-1")
    for label, data in (("named", named), ("rebuilt", rebuilt)):
        (tmp_path / label).mkdir()
        (tmp_path / label / "optimizer.pt").write_bytes(data)
        found = _security(tmp_path / label)
        assert len(found) == 1 and found[0].startswith("CKD601"), (label, found)
        assert f"would import `{module}`, which a resuming process has not imported" in found[0], found


def test_a_known_packages_unloaded_class_is_not_training_arguments_data(tmp_path: Path) -> None:
    """The TrainingArguments-data rule (NEWOBJ of no arguments + BUILD of TrainingArguments' fields) admits an
    in-house class whose package the user's resume script imports; a class of torch or transformers whose module a
    resuming process has not imported is not admitted so: the import itself is the hazard."""
    from ckptdoctor.pickle_verdict.judge import TRAINING_ARGS_FIELDS

    fields = {k: 1 for k in sorted(TRAINING_ARGS_FIELDS)}
    body = pickle.dumps(fields, protocol=2)[2:-1]  # the dict, without PROTO and STOP
    stream = b"\x80\x02ctorch._inductor.cpp_builder\nCppOptions\n)\x81" + body + b"b."
    (tmp_path / "training_args.bin").write_bytes(stream)
    found = _security(tmp_path)
    assert len(found) == 1 and "would import `torch._inductor.cpp_builder`" in found[0], found


def test_the_resume_modules_are_loaded_by_this_environments_resume_path() -> None:
    """What the set holds is loaded here when a bare DCP resume loads a file (``make_allowlist --modules``' leanest
    path): the set never claims a module this environment's resuming process lacks."""
    from bench.make_allowlist import _RESUME_DCP, _run_stack

    got = _run_stack((), Path("/nonexistent"), _RESUME_DCP)
    assert isinstance(got, dict), got
    assert pickle_policy.resume_modules() <= set(got["modules"])


def test_the_resume_modules_hold_what_every_resume_path_loads() -> None:
    """``resume_modules.json`` is what every stack's resume path had imported when it loaded a file (the
    intersection): torch and numpy's core, no test, compiler or model module, nothing a Lightning or bare DCP resume
    lacks (transformers, peft, accelerate)."""
    loaded = pickle_policy.resume_modules()
    assert {"torch", "torch.serialization", "torch.optim", "numpy", "collections", "pickle"} <= loaded
    # (``import torch`` itself imports a few ``torch.testing._internal`` modules: those are in, opinfo is not)
    for absent in ("torch._inductor", "torch.testing._internal.opinfo", "numpy.lib.tests", "transformers", "peft",
                   "accelerate", "torch._dynamo"):  # fmt: skip
        assert not any(m == absent or m.startswith(absent + ".") for m in loaded), absent
    doc = json.loads((Path(pickle_policy.__file__).with_name("resume_modules.json")).read_text())
    assert doc["modules"] == sorted(loaded) and len(doc["stacks"]) >= 2


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.planner", "reduce"),  # a re-exported function (functools.reduce)
        ("torch.distributed.checkpoint.metadata", "os"),  # a module
        ("torch.distributed.checkpoint.planner", "dataclass"),
        ("transformers.trainer_utils", "set_seed"),  # a function of a module whose enums are allowed
        ("transformers.trainer_utils", "os.system"),
        ("numpy.dtypes", "_add_dtype_helper"),
    ],
)
def test_no_wildcard_lets_a_function_or_module_through(module: str, name: str) -> None:
    assert standing(GlobalRef(module, name))[0] in (Standing.UNPROVEN, Standing.UNSAFE)
    assert not any(e.endswith("*") for e in pickle_policy.ALLOWED | pickle_policy.GENERATED)


def _write_pkg(root: Path, body: str) -> None:
    (root / "inhouse_args").mkdir(parents=True)
    (root / "inhouse_args" / "__init__.py").write_text(textwrap.dedent(body))


INHOUSE = """
    from dataclasses import dataclass, field
    from transformers import TrainingArguments

    @dataclass
    class MyArgs(TrainingArguments):
        team: str = field(default="search")

    class Evil(MyArgs):
        def __reduce__(self):
            return (print, ("x",))
"""


def test_an_inhouse_training_arguments_subclass_passes_installed_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkgs = tmp_path / "site"
    _write_pkg(pkgs, INHOUSE)
    monkeypatch.syspath_prepend(str(pkgs))
    import inhouse_args

    run = tmp_path / "run"
    run.mkdir()
    torch.save(inhouse_args.MyArgs(output_dir=str(tmp_path / "o"), report_to="none"), run / "training_args.bin")
    with monkeypatch.context() as m:  # the source proof, had a resuming process imported the package
        m.setattr(pickle_policy, "RESUME_MODULES", pickle_policy.resume_modules() | {"inhouse_args"})
        assert standing(GlobalRef("inhouse_args", "MyArgs"))[0] is Standing.ALLOWED  # derives from TrainingArguments
        assert standing(GlobalRef("inhouse_args", "Evil"))[0] is Standing.UNKNOWN  # defines __reduce__ itself
        assert _security(run) == []
    pickle_policy.clear_caches()
    # It has not (the module set holds no in-house package): the class is unproven, yet the stream rebuilds
    # TrainingArguments data of a package outside the known ones, which the user's own resume script imports
    assert standing(GlobalRef("inhouse_args", "MyArgs"))[0] is Standing.UNPROVEN
    assert _security(run) == []
    monkeypatch.syspath_prepend(str(tmp_path / "nothing"))
    import sys

    sys.path.remove(str(pkgs))
    pickle_policy.standing.cache_clear()
    pickle_policy._module_defs.cache_clear()
    assert standing(GlobalRef("inhouse_args", "MyArgs"))[0] is Standing.UNPROVEN
    assert _security(run) == []  # the stream rebuilds TrainingArguments data: NEWOBJ + BUILD of its fields


def test_an_absent_subclass_passes_as_newobj_data_but_a_reduce_of_the_same_name_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TrainingArguments subclass from a module absent here (an in-house package) is saved by ``torch.save`` as
    NEWOBJ + BUILD of its fields: the unpickler refuses NEWOBJ of anything but a class, so it passes. The same name
    REDUCEd with no arguments, then BUILT with the same fields, calls whatever callable the loader holds under that
    name: a CKD601 error, and the canary shows the loader really calls it."""
    import sys
    import types

    from ckptdoctor.pickle_verdict.judge import TRAINING_ARGS_FIELDS

    mod = types.ModuleType("ckd_inhouse_absent")
    called: list[str] = []

    class Args:
        pass

    def make_args() -> Args:
        called.append("make_args")
        return Args()

    for obj, name in ((Args, "Args"), (make_args, "make_args")):
        obj.__module__, obj.__qualname__ = mod.__name__, name
        setattr(mod, name, obj)

    class Reduced:
        def __reduce__(self) -> tuple[object, ...]:
            return (make_args, (), fields)

    fields = {f: 1 for f in TRAINING_ARGS_FIELDS} | {"output_dir": "out", "team": "search"}
    data = Args()
    data.__dict__.update(fields)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    for name, value in (("newobj", data), ("reduce", Reduced())):
        (tmp_path / name).mkdir()
        torch.save(value, tmp_path / name / "training_args.bin")
    assert torch.load(tmp_path / "reduce" / "training_args.bin", weights_only=False).__dict__ == fields
    assert called == ["make_args"]  # the REDUCE is live: loading calls the function
    monkeypatch.delitem(sys.modules, mod.__name__)
    assert standing(GlobalRef(mod.__name__, "Args"))[0] is Standing.UNPROVEN  # no source anywhere
    assert _security(tmp_path / "newobj") == []
    found = _security(tmp_path / "reduce")
    assert any(f.startswith("CKD601") and "ckd_inhouse_absent.make_args" in f for f in found), found


@pytest.mark.parametrize("protocol", range(6))
def test_a_pickled_range_is_data(tmp_path: Path, protocol: int) -> None:
    """``range`` is one of the builtins Python's pickle documentation itself admits ("Restricting Globals"); protocols
    0-2 name it ``__builtin__.xrange``, which the unpickler maps to ``builtins.range``. A call of a function beside it
    is still an error."""
    value = {"layers": range(0, 32, 2), "all": range(10**18)}
    data = pickle.dumps(value, protocol=protocol)
    assert pickle.loads(data) == value
    (tmp_path / "a.pkl").write_bytes(data)
    (tmp_path / "b.pkl").write_bytes(pickle.dumps({"r": range(3), "f": json.dumps}, protocol=protocol))
    found = _security(tmp_path)
    assert [f.split(":")[0] for f in found] == ["CKD601 b.pkl"], found
    assert "range" not in found[0]


def test_a_package_in_the_working_folder_vouches_for_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_pkg(tmp_path, "class Cfg:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert standing(GlobalRef("inhouse_args", "Cfg"))[0] is Standing.UNPROVEN


# GLOBAL collections.OrderedDict, MARK, {argparse.ArgumentParser: 1}, TUPLE, REDUCE: a class in a dict key handed
# to a call. The callee may call what it is handed; hashing a key calls its __hash__.
KEY_IN_CALL = b"\x80\x02ccollections\nOrderedDict\n(}cargparse\nArgumentParser\nK\x01st" + b"R."
CLASS_NAMED = pickle.dumps({"parser": argparse.ArgumentParser}, protocol=2)
FUNC_NAMED = pickle.dumps({"f": json.dumps}, protocol=2)


def test_a_class_in_a_dict_key_handed_to_a_call_is_an_error(tmp_path: Path) -> None:
    assert pickle.loads(KEY_IN_CALL)  # a valid stream
    for name, data in (("key.pkl", KEY_IN_CALL), ("func.pkl", FUNC_NAMED), ("named.pkl", CLASS_NAMED)):
        (tmp_path / name).write_bytes(data)
    found = _security(tmp_path)
    assert any(f.startswith("CKD601 key.pkl") and "argparse.ArgumentParser" in f for f in found), found
    assert any(f.startswith("CKD601 func.pkl") and "json.dumps" in f for f in found), found  # a function: denied
    assert any(f.startswith("CKD602 named.pkl") for f in found), found  # a proven class, only named: a warning


def test_a_pickle_naming_thousands_of_modules_costs_a_bounded_number_of_source_lookups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each global the allowlist does not settle costs a sys.path search and maybe a parse: a hostile stream naming
    5,000 distinct modules gets ``Limits.pickle_source_globals`` lookups, and the rest are unsafe all the same."""
    names = 5000
    body = b"".join(b"cckd_no_such_module_%d\nCls\n" % i for i in range(names))
    (tmp_path / "many.pkl").write_bytes(b"\x80\x02(" + body + b"l.")  # MARK, 5,000 GLOBALs, LIST, STOP
    looked_up: list[str] = []
    real = pickle_policy._module_defs

    def counting(module: str) -> object:
        looked_up.append(module)
        return real(module)

    monkeypatch.setattr(pickle_policy, "_module_defs", counting)
    report = scan(str(tmp_path), no_config=True)
    assert 0 < len(set(looked_up)) <= len(looked_up) <= Limits().pickle_source_globals
    [finding] = [f for f in report.findings if f.rule == "CKD601"]
    assert finding.severity is Severity.ERROR and f"and {names - 8} more" in finding.message
    assert "(limit)" in finding.message, finding.message  # the LIMIT note: not everything was looked up


def test_past_the_limit_a_proven_class_is_unproven_and_the_verdict_says_why() -> None:
    pf, _, _ = walk_pickle(pickle.dumps([argparse.Action, argparse.ArgumentParser], protocol=2))
    assert pf is not None
    free = judge(pf)
    assert len(free.unknown) == 2 and not free.unsafe and not free.limit  # proven classes, only named: CKD602
    capped = judge(pf, Limits(pickle_source_globals=1))
    assert capped.unknown == ("`argparse.Action`",) and capped.unsafe == ("`argparse.ArgumentParser`",)
    assert "more than 1 globals" in capped.limit


def test_run_rules_on_a_tree_without_verdicts_honours_the_selection_allowances(tmp_path: Path) -> None:
    (tmp_path / "ns.pkl").write_bytes(pickle.dumps(argparse.Action([], "a"), protocol=2))
    tree = discover(str(tmp_path))
    assert tree.pickle_verdicts is None
    allow = Selection(allow_globals=(("argparse.*", "--allow-global"),))
    for run in (run_rules, scan_tree):
        assert [f.rule for f in run(tree, Selection())] == ["CKD601"]
        assert run(tree, allow) == []


def test_allow_global_on_the_command_line_is_shown_in_text_and_json(tmp_path: Path) -> None:
    (tmp_path / "ns.pkl").write_bytes(pickle.dumps(argparse.Action([], "a"), protocol=2))
    runner = CliRunner()
    env = {"CKPTDOCTOR_USER_CONFIG": str(tmp_path / "absent.toml")}
    denied = runner.invoke(main, ["scan", "--no-config", str(tmp_path)], env=env)
    assert denied.exit_code == 1 and "CKD601" in denied.output and "argparse.Action" in denied.output
    text = runner.invoke(main, ["scan", "--allow-global", "argparse.*", str(tmp_path)], env=env)
    assert text.exit_code == 0, text.output
    assert "pickle global `argparse.Action` allowed by --allow-global `argparse.*`" in text.output
    doc = json.loads(runner.invoke(main, ["scan", "--format", "json", "--allow-global", "argparse.Action",
                                          str(tmp_path)], env=env).output)  # fmt: skip
    assert doc["findings"] == []
    assert doc["allowed_globals"] == [
        {"file": str(tmp_path / "ns.pkl"), "global": "argparse.Action", "pattern": "argparse.Action",
         "origin": "--allow-global"}
    ]  # fmt: skip


def test_the_user_configuration_allows_and_a_scanned_settings_file_cannot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "ns.pkl").write_bytes(pickle.dumps(argparse.Action([], "a"), protocol=2))
    user = tmp_path / "user.toml"
    user.write_text('allow-globals = ["argparse.Action"]\n')
    runner = CliRunner()
    ok = runner.invoke(main, ["scan", str(run)], env={"CKPTDOCTOR_USER_CONFIG": str(user)})
    assert ok.exit_code == 0 and f"allowed by allow-globals in {user}" in ok.output, ok.output
    (run / ".ckptdoctor.toml").write_text('allow-globals = ["argparse.Action"]\n')
    smuggled = runner.invoke(main, ["scan", str(run)], env={"CKPTDOCTOR_USER_CONFIG": str(tmp_path / "none")})
    assert smuggled.exit_code == 2 and "unknown setting" in smuggled.output


# a wildcard over a module that holds a dangerous name names it too (issue 26: `builtins.*` was accepted)
@pytest.mark.parametrize("pattern", ["os.*", "builtins.eval", "posix.system", "subprocess.Popen", "os", "a b.c",
                                     "builtins.*", "torch.*", "numpy.*", "functools.*", "pathlib.*"])
def test_allow_global_never_admits_code(tmp_path: Path, pattern: str) -> None:
    result = CliRunner().invoke(main, ["scan", "--allow-global", pattern, str(tmp_path)],
                                env={"CKPTDOCTOR_USER_CONFIG": str(tmp_path / "none")})  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "cannot be allowed" in result.output or "is not `module.Name`" in result.output, result.output


@pytest.mark.parametrize("pattern", ["argparse.*", "collections.*", "mycompany.models.*", "torch.nn.Linear"])
def test_allow_global_takes_a_wildcard_over_harmless_modules(pattern: str) -> None:
    assert pickle_policy.check_pattern(pattern) is None


def test_gate_and_fix_take_allow_global(tmp_path: Path) -> None:
    runner = CliRunner()
    for cmd in (["gate"], ["fix", "--dry-run"]):
        result = runner.invoke(main, [*cmd, "--help"])
        assert "--allow-global" in result.output


# ---------------------------------------------------------------------------------------------------------------
# Soundness: the static verdict against the real unpickler, with no code run.

POOL = [
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("builtins", "set"),
    ("argparse", "Namespace"), ("argparse", "ArgumentParser"), ("json", "dumps"), ("os", "system"),
    ("builtins", "eval"), ("transformers.training_args", "TrainingArguments"), ("inhouse.nowhere", "Cfg"),
    ("torch.distributed.checkpoint.planner", "reduce"), ("numpy", "dtype"), ("builtins", "getattr"),
]  # fmt: skip


class _Stub:
    """What the recording unpickler hands back for every global: inert, accepts any call, state or item."""

    def __init__(self, *a: object, **k: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __call__(self, *a: object, **k: object) -> _Stub:
        return _Stub()


class _Recorder(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.seen: list[tuple[str, str]] = []

    def find_class(self, module: str, name: str) -> type[_Stub]:  # refuses every real global: a stub instead
        self.seen.append((module, name))
        return _Stub


def _glob(i: int, stack_global: bool) -> bytes:
    m, n = POOL[i]
    if stack_global:
        return b"\x8c" + bytes([len(m)]) + m.encode() + b"\x8c" + bytes([len(n)]) + n.encode() + b"\x93"
    return b"c" + m.encode() + b"\n" + n.encode() + b"\n"


ITEM = st.tuples(st.integers(0, len(POOL) - 1), st.booleans(), st.sampled_from(["name", "call", "newobj", "key",
                                                                                "set", "arg"]))  # fmt: skip


def _stream(items: list[tuple[int, bool, str]]) -> bytes:
    out = [b"\x80\x04", b"]("]  # a list, MARK
    for i, sg, how in items:
        g = _glob(i, sg)
        if how == "name":
            out.append(g)
        elif how == "call":
            out.append(g + b")R")
        elif how == "newobj":
            out.append(g + b")\x81}\x8c\x01aK\x01sb")
        elif how == "key":
            out.append(b"}" + g + b"K\x01s")
        elif how == "set":
            out.append(b"\x8f(" + g + b"\x90")
        else:  # handed to an allowed callable inside a dict key
            out.append(b"ccollections\nOrderedDict\n(}" + g + b"K\x01st" + b"R")
    out.append(b"e.")
    return b"".join(out)


def unallowed_seen(data: bytes, verdict: object = None) -> list[GlobalRef]:
    """The globals a recording unpickler of ``data`` resolves that the policy does not allow, when the static verdict
    (``verdict``, else ``data`` walked and judged as a raw pickle) has no security finding; [] otherwise. Not empty
    means unsound. Shared with bench/soundness.py, which runs the same property far longer."""
    if verdict is None:
        facts, problems, _ = walk_pickle(data)
        if facts is None or problems:
            return []  # CKD603 (malformed) or unreadable: a security finding either way
        verdict = judge(facts)
    assert isinstance(verdict, Verdict)
    rec = _Recorder(data)
    with contextlib.suppress(Exception):  # a refused or malformed stream stops the load: what it saw still counts
        rec.load()
    if verdict.unsafe or verdict.unknown:
        return []
    admitted = {g for g, _ in verdict.admitted}
    seen = [GlobalRef(m, n) for m, n in rec.seen]
    return [g for g in seen if standing(g)[0] is not Standing.ALLOWED and g.dotted not in admitted]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ITEM, min_size=1, max_size=6), st.integers(0, 3))
def test_a_clean_verdict_means_the_unpickler_sees_only_allowed_names(items: list[tuple[int, bool, str]],
                                                                      cut: int) -> None:  # fmt: skip
    data = _stream(items)
    data = data[: len(data) - cut] if cut else data  # hostile: truncated streams too
    assert unallowed_seen(data) == [], items

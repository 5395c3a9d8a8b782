"""``model.frozen`` (``dataclass(frozen=True, slots=True, eq=False, repr=False)`` with ``model.frozen_value``) gives
a class the same equality, hash and repr that ``dataclass(frozen=True, slots=True)`` generates (it only builds them
without compiling)."""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from ckptdoctor.model import GlobalRef, ProblemKind, ReadProblem, TensorRef, frozen, mutable


@dataclass(frozen=True, slots=True)
class _Generated:
    a: int
    b: tuple[float, ...]
    c: str | None = None


@frozen
class _Built:
    a: int
    b: tuple[float, ...]
    c: str | None = None


@dataclass(frozen=True, slots=True)
class _GeneratedOne:
    x: float


@frozen
class _BuiltOne:
    x: float


NAN = math.nan
CASES = [(1, (2.0,), None), (1, (2.0,), "c"), (0, (), "x'y"), (1, (NAN,), None)]


@pytest.mark.parametrize("one", CASES)
@pytest.mark.parametrize("other", CASES)
def test_eq_hash_repr_match_the_generated_ones(one: tuple[Any, ...], other: tuple[Any, ...]) -> None:
    g1, g2, b1, b2 = _Generated(*one), _Generated(*other), _Built(*one), _Built(*other)
    assert (b1 == b2) == (g1 == g2) and (b1 != b2) == (g1 != g2)
    assert hash(b1) == hash(g1)
    assert repr(b1) == repr(g1).replace("_Generated", "_Built")
    assert b1.__eq__(g1) is NotImplemented and (b1 == 1) is False


def test_frozen_values_are_frozen_slotted_dataclasses() -> None:
    built = _Built(1, (2.0,))
    assert dataclasses.is_dataclass(built) and not hasattr(built, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.a = 2  # type: ignore[misc]


def test_one_field_and_nan_identity() -> None:
    assert hash(_BuiltOne(1.5)) == hash(_GeneratedOne(1.5)) == hash((1.5,))
    assert _BuiltOne(NAN) == _BuiltOne(NAN) and _GeneratedOne(NAN) == _GeneratedOne(NAN)  # tuple identity, as before
    assert _BuiltOne(float("nan")) != _BuiltOne(float("nan"))
    assert repr(_BuiltOne(2.0)) == "_BuiltOne(x=2.0)"


def test_still_a_frozen_slotted_dataclass() -> None:
    ref = GlobalRef("collections", "OrderedDict")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.module = "os"  # type: ignore[misc]
    assert not hasattr(ref, "__dict__") and dataclasses.is_dataclass(ref)
    assert dataclasses.replace(ref, name="Counter") == GlobalRef("collections", "Counter")
    assert pickle.loads(pickle.dumps(ref)) == ref and {ref, GlobalRef("collections", "OrderedDict")} == {ref}
    assert repr(ReadProblem(ProblemKind.EMPTY, "m")) == "ReadProblem(kind=<ProblemKind.EMPTY: 'empty'>, message='m')"
    t = TensorRef("F32", (2,), (1,), 0, "0", 2, "cpu")
    assert t == dataclasses.replace(t) and dataclasses.astuple(t)[0] == "F32"


@frozen
class _Defaults:
    a: int
    b: list[int] = field(default_factory=list)
    c: str = "c"
    d: int | None = field(default=None, init=False, compare=False)


def test_init_binds_as_the_generated_one() -> None:
    made = _Defaults(1)
    assert (made.a, made.b, made.c, made.d) == (1, [], "c", None)
    assert _Defaults(1).b is not made.b  # a fresh list per value, as default_factory makes
    assert _Defaults(2, [3], c="x") == _Defaults(a=2, b=[3], c="x")
    with pytest.raises(TypeError):
        _Defaults()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Defaults(1, a=2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        _Defaults(1, d=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Defaults(1, [], "c", 4)  # type: ignore[call-arg]
    assert pickle.loads(pickle.dumps(made)) == made and dataclasses.replace(made, c="y").c == "y"


def test_a_field_without_default_after_one_with_is_refused() -> None:
    class Bad:
        a: int = 1
        b: int

    with pytest.raises(TypeError, match="follows default"):
        frozen(Bad)


@frozen
class _Often:
    a: int
    b: list[int] = field(default_factory=list)
    d: int | None = field(default=None, init=False, compare=False)


def test_init_is_the_generated_one_once_a_class_is_built_often() -> None:
    from ckptdoctor import model

    before = _Often.__init__
    made = [_Often(i) if i % 2 else _Often(a=i, b=[i]) for i in range(model._COMPILE_AFTER + 2)]
    assert _Often.__init__ is not before and _Often.__init__.__qualname__ == "_Often.__init__"
    assert [(m.a, m.b, m.d) for m in made[:4]] == [(0, [0], None), (1, [], None), (2, [2], None), (3, [], None)]
    assert (made[-1].a, made[-1].d) == (model._COMPILE_AFTER + 1, None)
    assert _Often(5, [1]) == _Often(a=5, b=[1]) and _Often(1).b is not _Often(1).b
    with pytest.raises(TypeError):
        _Often()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Often(1, d=2)  # type: ignore[call-arg]


_SENTINEL = object()


def _declared() -> list[type]:
    """Classes declared as the package declares its values: every kind of field it uses, and a method (each with a
    docstring: ``frozen`` gives one to a class without)."""

    class Plain:
        """doc"""

        a: int
        b: str | None = None

    class Fields:
        """doc"""

        a: tuple[int, ...]
        b: list[int] = field(default_factory=list)
        c: int | None = field(default=None, compare=False)
        d: object = field(default=_SENTINEL, repr=False, compare=False)
        e: int | None = field(default=None, init=False, repr=False, compare=False)
        f: str = field(default="", compare=False, metadata={"m": 1})

        def doubled(self) -> tuple[int, ...]:
            return self.a * 2

    class Empty:
        """doc"""

    return [Plain, Fields, Empty]


def _shape(cls: type) -> tuple[Any, ...]:
    fields = [(f.name, f.type, f.default, f.default_factory, f.init, f.repr, f.hash, f.compare, dict(f.metadata),
               f.kw_only, f._field_type) for f in dataclasses.fields(cls)]  # type: ignore[attr-defined]
    return (fields, cls.__slots__, cls.__match_args__, repr(cls.__dataclass_params__),  # type: ignore[attr-defined]
            sorted(vars(cls)), cls.__name__, cls.__qualname__, cls.__module__, cls.__doc__, cls.__mro__[1:])


def test_the_class_is_the_one_dataclass_makes() -> None:
    """``model._slotted`` makes in one pass the class ``dataclass(init=False, slots=True, eq=False, repr=False)``
    makes: the same fields (each attribute of each), slots, flags, names and attributes."""
    from ckptdoctor import model

    fast = [model._slotted(cls, dict(model._FROZEN_METHODS)) for cls in _declared()]
    slow = []
    for cls in _declared():
        made = model._dataclass_made(cls)
        for name, func in model._FROZEN_METHODS.items():
            setattr(made, name, func)
        model.frozen_value(made)
        slow.append(made)
    for one, other in zip(fast, slow, strict=True):
        assert _shape(one) == _shape(other)


def test_a_class_dataclass_must_sort_out_is_made_by_dataclass() -> None:
    """A ``ClassVar`` is no field, a base's fields come first: ``frozen`` leaves those classes to ``dataclass``."""
    @frozen
    class Counted:
        kinds: ClassVar[tuple[str, ...]] = ("a",)
        a: int

    @frozen
    class Base:
        a: int

    @frozen
    class Derived(Base):
        b: int = 2

    assert [f.name for f in dataclasses.fields(Counted)] == ["a"] and Counted(1).kinds == ("a",)
    assert Counted(1) == Counted(1) and repr(Counted(1)).endswith("Counted(a=1)")
    assert [f.name for f in dataclasses.fields(Derived)] == ["a", "b"] and Derived(1) == Derived(1, 2)


def test_values_built_in_one_pass_behave() -> None:
    """Equality, hash, repr, replace, pickling and refusal of assignment on a class ``_slotted`` made."""
    made = _FieldsValue((1,), [2], 3)
    assert made == _FieldsValue((1,), [2], 4) and hash(_FieldsValue((1,), (), 5)) == hash(_FieldsValue((1,), ()))  # type: ignore[arg-type]
    assert repr(made) == "_FieldsValue(a=(1,), b=[2], c=3, f='')" and made.doubled() == (1, 1)
    assert dataclasses.replace(made, a=(5,)).a == (5,) and made.e is None
    assert pickle.loads(pickle.dumps(made)) == made and not hasattr(made, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.a = (2,)  # type: ignore[misc]
    with pytest.raises(ValueError, match="mutable default"):

        @frozen
        class Bad:
            a: list[int] = []  # noqa: RUF012


@frozen
class _FieldsValue:
    a: tuple[int, ...]
    b: list[int] = field(default_factory=list)
    c: int | None = field(default=None, compare=False)
    d: object = field(default=_SENTINEL, repr=False, compare=False)
    e: int | None = field(default=None, init=False, repr=False, compare=False)
    f: str = field(default="", compare=False)

    def doubled(self) -> tuple[int, ...]:
        return self.a * 2


@dataclass(slots=True)
class _GeneratedRecord:
    a: int
    b: list[int] = field(default_factory=list)
    c: str = "c"


@mutable
class _Record:
    a: int
    b: list[int] = field(default_factory=list)
    c: str = "c"


def test_mutable_behaves_as_a_slotted_dataclass() -> None:
    """``model.mutable`` makes what ``dataclass(slots=True)`` makes, without compiling: the same ``__init__``
    (defaults, factories, keywords), equality and repr, no hash, and fields that can be set."""
    made, generated = _Record(1), _GeneratedRecord(1)
    assert (made.a, made.b, made.c) == (generated.a, generated.b, generated.c) and _Record(1).b is not made.b
    assert repr(_Record(2, [3], c="x")) == repr(_GeneratedRecord(2, [3], c="x")).replace("_GeneratedRecord", "_Record")
    assert _Record(1, [2]) == _Record(a=1, b=[2]) and _Record(1) != _Record(2)
    assert made.__eq__(generated) is NotImplemented
    assert _Record.__hash__ is None and _GeneratedRecord.__hash__ is None
    made.b.append(5)
    made.c = "d"
    assert (made.b, made.c) == ([5], "d") and not hasattr(made, "__dict__") and dataclasses.is_dataclass(made)
    with pytest.raises(AttributeError):
        made.other = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        _Record()  # type: ignore[call-arg]
    assert pickle.loads(pickle.dumps(made)) == made and dataclasses.replace(made, a=7).a == 7


@frozen
class _Positional:
    a: int
    b: int = 0


def test_builds_with_every_field_by_position_never_make_the_generated_init() -> None:
    """Only builds that bind keywords or defaults count towards making the generated ``__init__``: a class always
    built with every field by position (as the verdict cache decodes its values) keeps the closure."""
    from ckptdoctor import model

    before = _Positional.__init__
    made = [_Positional(i, i + 1) for i in range(model._COMPILE_AFTER * 2)]
    last = model._COMPILE_AFTER * 2 - 1
    assert _Positional.__init__ is before and (made[-1].a, made[-1].b) == (last, last + 1)
    assert [_Positional(i).b for i in range(model._COMPILE_AFTER + 1)][-1] == 0 and _Positional.__init__ is not before


@frozen
class _Kept:
    a: int
    _memo_slots = ("_double",)

    def double(self) -> int:
        try:
            return self._double  # type: ignore[attr-defined,no-any-return]
        except AttributeError:
            object.__setattr__(self, "_double", self.a * 2)
            return self.a * 2


def test_memo_slots_are_no_fields() -> None:
    """The slots a class names under ``model.MEMO_SLOTS`` hold what a value keeps once asked: no field, so not
    compared, hashed, shown, pickled nor copied by ``replace``; a class ``dataclass`` must make cannot have them."""
    one = _Kept(2)
    assert one.double() == 4 and one._double == 4  # type: ignore[attr-defined]
    assert [f.name for f in dataclasses.fields(_Kept)] == ["a"] and not hasattr(_Kept, "_memo_slots")
    assert one == _Kept(2) and hash(one) == hash(_Kept(2)) and repr(one).endswith("Kept(a=2)")
    for copy in (pickle.loads(pickle.dumps(one)), dataclasses.replace(one)):
        assert copy == one and not hasattr(copy, "_double")
    with pytest.raises(TypeError, match="_memo_slots"):

        @frozen
        class Counted:
            kinds: ClassVar[tuple[str, ...]] = ("a",)
            a: int
            _memo_slots = ("_b",)

"""`@op`, `OpInfo`, `OpRegistry` and the `omniflow.ops` entry points."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from engine.spec.calls import NodeContext
from engine.spec.graph import PortSpec
from engine.spec.ops import (
    OpConfig,
    OpDefinitionError,
    OpNotAllowedError,
    OpRegistry,
    UnknownOpError,
    default_ops,
    op,
    op_info,
)


def test_ports_and_params_come_from_the_signature() -> None:
    @op("text.demo")
    def demo(ctx: NodeContext, text: str, ids: list[int], doc: dict, blob: bytes, thing: Any, maybe: str | None,
             limit: int = 3, mode: Literal["a", "b"] = "a", scale: float | None = None, tags: list[str] = ()) -> str:
        """One line.

        More words."""
        return text

    info = op_info(demo)
    assert info is not None and info.name == "text.demo" and info.description == "One line."
    assert dict(info.inputs) == {"text": PortSpec("text"), "ids": PortSpec("tokens"), "doc": PortSpec("json"),
                                 "blob": PortSpec("any"), "thing": PortSpec("any"), "maybe": PortSpec("text")}
    assert dict(info.outputs) == {"out": PortSpec("text")}
    assert info.params_json_schema() == {"type": "object", "properties": {
        "limit": {"type": "integer", "default": 3},
        "mode": {"enum": ["a", "b"], "default": "a"},
        "scale": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None},
        "tags": {"type": "array", "items": {"type": "string"}, "default": []},
    }}
    assert (info.takes_ctx, info.is_coroutine, info.is_generator) == (True, False, False)


def test_streams_and_explicit_ports() -> None:
    @op("text.words")
    def words(text: str) -> Iterator[str]:
        yield from text.split()

    @op("text.upper", outputs={"word": "text"})
    async def upper(words: AsyncIterator[str]) -> AsyncIterator[str]:
        async for w in words:
            yield w.upper()

    @op("text.pick", inputs={"a": {"type": "json", "optional": True}}, outputs={"x": "json", "y": "tokens"})
    def pick(a: Any = None, model: str = "m", size: int = 1) -> dict:
        return {}

    assert dict(op_info(words).outputs) == {"out": PortSpec("text")} and op_info(words).is_generator
    assert dict(op_info(upper).inputs) == {"words": PortSpec("text")} and op_info(upper).is_async_generator
    info = op_info(pick)
    assert dict(info.inputs) == {"a": PortSpec("json", optional=True)}
    assert dict(info.outputs) == {"x": PortSpec("json"), "y": PortSpec("tokens")}
    assert set(info.params_json_schema()["properties"]) == {"model", "size"}


def test_op_info_is_immutable_and_plain_functions_have_none() -> None:
    @op("text.same")
    def same(x: int) -> int:
        return x

    info = op_info(same)
    with pytest.raises(AttributeError):
        info.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        info.inputs["y"] = PortSpec("json")  # type: ignore[index]
    with pytest.raises(TypeError):
        info.params_schema["type"] = "array"  # type: ignore[index]
    assert op_info(lambda x: x) is None and op_info(len) is None


@pytest.mark.parametrize("name", ["square", "Diamond.square", "diamond.", "a..b", "a.b-c", "a:b", "os.path:join", ""])
def test_op_names_follow_the_grammar(name: str) -> None:
    with pytest.raises(OpDefinitionError, match="op name"):
        op(name)(lambda x: x)


def test_registry_lookups_duplicates_and_suggestions() -> None:
    @op("diamond.square")
    def square(x: int) -> int:
        return x * x

    @op("diamond.square")
    def other(x: int) -> int:
        return x

    registry = OpRegistry([square])
    assert registry.get("diamond.square").fn is square and len(registry) == 1
    registry.add(square)  # the same function again is no duplicate
    with pytest.raises(OpDefinitionError, match=r"'diamond.square' is defined twice: by .*:.*square and by .*other"):
        registry.add(other)
    with pytest.raises(UnknownOpError, match=r"'diamond.sqare' is not a registered op; did you mean 'diamond.square'"):
        registry.get("diamond.sqare")
    with pytest.raises(OpDefinitionError, match="not an op"):
        registry.add(lambda x: x)


def test_output_folders_are_declared_with_the_op() -> None:
    @op("media.keep", output_dirs=("out_dir",))
    def keep(text: str, out_dir: str = "here", level: int = 1) -> str:
        return text

    info = op_info(keep)
    assert info is not None and info.output_dirs == ("out_dir",) and info.to_dict()["output_dirs"] == ["out_dir"]
    assert op_info(_plain_op).output_dirs == ()
    for wrong in ("text", "level", "missing"):  # an input port, a non-string param, no param at all
        with pytest.raises(OpDefinitionError, match=f"output_dirs names {wrong!r}, which is not a string param"):
            op("media.bad", output_dirs=(wrong,))(keep)


@op("test.plain")
def _plain_op(x: int) -> int:
    return x


def test_registry_finds_an_op_by_name_or_by_its_function_without_importing() -> None:
    registry = OpRegistry([_plain_op])
    before = set(sys.modules)
    assert registry.find("test.plain").fn is _plain_op
    assert registry.find(f"{__name__}:_plain_op").fn is _plain_op
    assert registry.find(f"{__name__}:other") is None
    assert registry.find("omniflow_absent_pkg:_plain_op") is None
    assert registry.find(f"{__name__}:_plain_op.attr") is None
    assert registry.find(None) is None and registry.find("test.missing") is None
    assert not {m for m in set(sys.modules) - before if m.startswith("omniflow_absent_pkg")}


def test_policy_never_imports_what_a_spec_names() -> None:
    registry = OpRegistry()
    before = set(sys.modules)
    strict, trusted = OpConfig(registry, allow_module_ops=False), OpConfig(registry, allow_module_ops=True)
    assert isinstance(strict.problem("omniflow_absent_pkg.mod"), UnknownOpError)
    assert isinstance(strict.problem("omniflow_absent_pkg.sub:a.b"), OpNotAllowedError)
    assert trusted.problem("omniflow_absent_pkg.sub:a") is None  # checked by its form: imported only when run
    walk = trusted.problem("omniflow_absent_pkg.sub:a.b")  # an attribute path: refused even where trusted
    assert isinstance(walk, OpNotAllowedError)
    assert str(walk) == ("op 'omniflow_absent_pkg.sub:a.b' walks the attribute path 'a.b' through module"
                         " 'omniflow_absent_pkg.sub': a module op names one function defined in its module"
                         " ('omniflow_absent_pkg.sub:b' if it is defined there)")
    assert isinstance(trusted.problem("workflows.ops.common:Path.write_text"), OpNotAllowedError)
    assert isinstance(strict.problem("os:system"), OpNotAllowedError)
    assert isinstance(strict.problem("workflows.ops.common:Path.write_text"), OpNotAllowedError)
    assert trusted.problem("os:system") is None
    assert isinstance(trusted.problem("omniflow_absent_pkg.mod"), UnknownOpError)
    assert isinstance(trusted.problem("not an op"), UnknownOpError)
    assert not {m for m in set(sys.modules) - before if m.startswith("omniflow_absent_pkg")}


def _distribution(root: Path, name: str, modules: dict[str, str], entries: dict[str, str]) -> None:
    """A distribution installed in `root`: its modules and a dist-info naming `omniflow.ops` entry points."""
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[omniflow.ops]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


OPS_SOURCE = '''
from engine.spec.ops import op
from json import loads  # imported, not defined here: not collected

@op("extra.double")
def double(x: int) -> int:
    """Twice x."""
    return 2 * x

def helper(x):
    return x
'''


def test_default_ops_collects_entry_point_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _distribution(tmp_path, "omniflow_extra_ops", {"omniflow_extra_ops_mod": OPS_SOURCE},
                  {"extra": "omniflow_extra_ops_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = default_ops()
    assert registry.get("extra.double").fn(4) == 8
    assert registry.get("extra.double").info.description == "Twice x."
    assert {"diamond.square", "media.save_outputs"} <= {o.info.name for o in registry.ops}  # the examples' too
    assert all(o.info.name != "helper" for o in registry.ops)
    assert "extra.double" not in default_ops(load_entry_points=False)


def test_two_packages_defining_one_name_are_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _distribution(tmp_path, "omniflow_dup_a", {"omniflow_dup_a_mod": OPS_SOURCE}, {"a": "omniflow_dup_a_mod"})
    _distribution(tmp_path, "omniflow_dup_b", {"omniflow_dup_b_mod": OPS_SOURCE}, {"b": "omniflow_dup_b_mod"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(OpDefinitionError, match=r"'extra.double' is defined twice: by omniflow_dup_a_mod:double"
                                                r" and by omniflow_dup_b_mod:double"):
        default_ops()

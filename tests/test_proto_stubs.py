"""superneurons/proto/superneurons_pb2.pyi, the type checker's view of the generated messages, says what the
schema the runtime loads says: every message and enum with every field and value, and nothing else. `make proto`
writes both files; this catches a schema change whose stubs were not regenerated."""
from __future__ import annotations

import ast
from pathlib import Path

from superneurons.proto import superneurons_pb2 as pb

STUBS = Path(pb.__file__).with_suffix(".pyi")


def _stub_classes() -> dict[str, ast.ClassDef]:
    """Every class of the stub file by its dotted path (nested messages and enums as Outer.Inner)."""
    found: dict[str, ast.ClassDef] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = node
                walk(node.body, prefix + node.name + ".")

    walk(ast.parse(STUBS.read_text()).body, "")
    return found


def _annotated_names(cls: ast.ClassDef, class_vars: bool) -> set[str]:
    """The names a class body annotates: with `class_vars`, those under ClassVar[...] (enum values, field
    numbers), else the rest (message fields, and a message's copies of its nested enums' values)."""
    names = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            is_class_var = isinstance(n.annotation, ast.Subscript) and ast.unparse(n.annotation.value) == "_ClassVar"
            if is_class_var == class_vars:
                names.add(n.target.id)
    return names


def _runtime_types() -> tuple[dict[str, object], dict[str, object]]:
    """Messages and enums of the loaded schema by their path below the package (Outer.Inner)."""
    messages: dict[str, object] = {}
    enums: dict[str, object] = {}

    def walk(desc, prefix: str) -> None:
        path = prefix + desc.name
        messages[path] = desc
        for e in desc.enum_types:
            enums[path + "." + e.name] = e
        for nested in desc.nested_types:
            walk(nested, path + ".")

    for desc in pb.DESCRIPTOR.message_types_by_name.values():
        walk(desc, "")
    for e in pb.DESCRIPTOR.enum_types_by_name.values():
        enums[e.name] = e
    return messages, enums


def test_stubs_hold_every_message_field_and_enum_value_of_the_schema():
    stubs = _stub_classes()
    messages, enums = _runtime_types()
    assert set(stubs) == set(messages) | set(enums)
    for path, desc in messages.items():
        fields = {f.name for f in desc.fields}
        values = {v.name for e in desc.enum_types for v in e.values}
        assert _annotated_names(stubs[path], class_vars=False) == fields | values, path
        assert _annotated_names(stubs[path], class_vars=True) == {f.upper() + "_FIELD_NUMBER" for f in fields}, path
    for path, desc in enums.items():
        assert _annotated_names(stubs[path], class_vars=True) == {v.name for v in desc.values}, path


def test_stubs_ship_with_the_package():
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "proto/*.pyi" in project["tool"]["setuptools"]["package-data"]["superneurons"]

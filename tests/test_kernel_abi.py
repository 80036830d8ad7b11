"""The ctypes side of the C kernels against the C source: every exported function's arity,
argument and result types (its one prototype in kernels.h, and its definition), the parameter
structs' fields, every allocation checked, and every status a kernel returns checked by its
wrapper. Parses the sources (no compiler needed)."""

from __future__ import annotations

import ast
import ctypes
import re
from pathlib import Path

import pytest

from minisgl.kernel import abi, cpu
from minisgl.kernel.build import HEADERS, SOURCES

_CTYPE_CLASSES = {
    ctypes.c_void_p: "pointer",
    ctypes.c_int64: "int64",
    ctypes.c_int: "int",
    ctypes.c_float: "float",
    None: "void",
    abi.ProjectionParams: "projection",  # a struct nested in decode_layer
    abi.QuantizedWeightParams: "quantized_weight",  # nested in projection
}
_C_SCALARS = {"int64_t": "int64", "int": "int", "float": "float", "void": "void"}


def _without_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _source_without_comments() -> str:
    """Every source and header of the library, one after another."""
    return "\n".join(_without_comments(path.read_text()) for path in SOURCES + HEADERS)


def _interface_without_comments() -> str:
    """kernels.h: the library's exports."""
    (interface,) = [path for path in HEADERS if path.name == "kernels.h"]
    return _without_comments(interface.read_text())


def _type_class(declaration: str) -> str:
    """pointer / int64 / int / float / void of a C parameter or result declaration."""
    if "*" in declaration:
        return "pointer"
    words = [w for w in declaration.split() if w not in ("const", "unsigned", "signed")]
    # A parameter ends with its name; a bare result type or `void` is the type itself.
    type_name = words[0] if len(words) == 1 else " ".join(words[:-1])
    assert type_name in _C_SCALARS, f"unexpected C type {declaration!r}"
    return _C_SCALARS[type_name]


def _functions(text: str, end: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (result class, argument classes) of every non-static minisgl_ function whose
    parameter list is followed by `end` ("{": definitions, ";": prototypes)."""
    found = {}
    pattern = r"^(?!static)([A-Za-z_][\w ]*?[\w*])\s*\b(minisgl_\w+)\s*\(([^)]*)\)\s*" + end
    for match in re.finditer(pattern, text, flags=re.M):
        result, name, params = match.groups()
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [_type_class(p) for p in params.split(",")]
        assert name not in found, f"{name} appears twice"
        found[name] = (_type_class(result), args)
    return found


def _exported_functions() -> dict[str, tuple[str, list[str]]]:
    """The prototypes of kernels.h, each the one declaration of a function some source defines
    with the same types (and no source defines an exported function kernels.h lacks)."""
    declared = _functions(_interface_without_comments(), ";")
    defined: dict[str, tuple[str, list[str]]] = {}
    for path in SOURCES:
        for name, types in _functions(_without_comments(path.read_text()), r"\{").items():
            assert name not in defined, f"{name} defined twice"
            defined[name] = types
    assert defined == declared
    return declared


def test_every_exported_function_matches_its_ctypes_prototype():
    exported = _exported_functions()
    assert len(exported) > 20  # the parser found the definitions
    assert set(exported) == set(abi.SIGNATURES) == set(abi.RESTYPES)
    for name, (result, args) in exported.items():
        ours = [_CTYPE_CLASSES[t] for t in abi.SIGNATURES[name]]
        assert ours == args, f"{name}: ctypes {ours} != C {args}"
        assert _CTYPE_CLASSES[abi.RESTYPES[name]] == result, f"{name}: result type"


def _c_struct_fields(name: str) -> list[tuple[str, str]]:
    body = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + ";", _source_without_comments())
    assert body is not None, f"struct {name} not found"
    fields = []
    for declaration in filter(str.strip, body.group(1).split(";")):
        # `[const] type *a, *b, c`: each declarator carries its own star.
        first, *others = declaration.split(",")
        match = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*(\**)\s*(\w+)\s*", first)
        assert match is not None, f"unexpected field declaration {declaration!r}"
        base, stars, name = match.groups()
        declarators = [(name, bool(stars))] + [(d.strip(" *"), "*" in d) for d in others]
        for field, pointer in declarators:
            fields.append((field, "pointer" if pointer else _C_SCALARS.get(base, base)))
    return fields


@pytest.mark.parametrize(
    "c_name,struct",
    [
        ("quantized_weight", abi.QuantizedWeightParams),
        ("projection", abi.ProjectionParams),
        ("decode_layer", cpu.DecodeLayerParams),
        ("decode_model", cpu.DecodeModelParams),
    ],
)
def test_parameter_structs_match_the_c_layout(c_name, struct):
    ours = [(field, _CTYPE_CLASSES[kind]) for field, kind in struct._fields_]
    assert ours == _c_struct_fields(c_name)


def test_every_allocation_goes_through_the_checked_allocator():
    """kernel_alloc is the one place memory is asked for: callers test its NULL, and the tests'
    failure hook reaches every allocation."""
    source = _source_without_comments()
    start = re.search(r"^void\* kernel_alloc\([^)]*\)\s*\{", source, flags=re.M).start()
    allocator = source[start : source.index("\n}\n", start)]
    calls = re.findall(r"\b(?:malloc|calloc|realloc|aligned_alloc)\s*\(", source)
    inside = re.findall(r"\b(?:malloc|calloc|realloc|aligned_alloc)\s*\(", allocator)
    assert len(calls) == len(inside) == 1


def test_every_status_a_kernel_returns_is_checked_by_its_wrapper():
    """A kernel returning a status (an int, besides the feature queries) is called only as
    `status = self.lib.<kernel>(...)`, and its wrapper reads that status afterwards (passes it
    to check_status, or tests it itself): no failure is dropped."""
    status_kernels = {
        name
        for name, restype in abi.RESTYPES.items()
        if restype is ctypes.c_int
        and not name.startswith("minisgl_has_")
        and name not in abi.ANSWERS
    }
    wrappers = sorted(Path(cpu.__file__).parent.glob("*.py"))  # every part of CpuKernels
    trees = [ast.parse(path.read_text()) for path in wrappers]
    checked, called = set(), set()
    for function in (node for tree in trees for node in ast.walk(tree)):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in status_kernels:
                called.add(node.func.attr)
        for node in ast.walk(function):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            func = node.value.func
            if not (isinstance(func, ast.Attribute) and func.attr in status_kernels):
                continue
            (target,) = node.targets
            assert isinstance(target, ast.Name), f"{function.name}: {func.attr}'s status"
            reads = [
                n
                for n in ast.walk(function)
                if isinstance(n, ast.Name)
                and n.id == target.id
                and isinstance(n.ctx, ast.Load)
                and n.lineno > node.lineno
            ]
            assert reads, f"{function.name} never reads {func.attr}'s status"
            checked.add(func.attr)
    assert called and called == checked, f"statuses dropped: {sorted(called - checked)}"


def test_status_codes_match_the_c_definitions():
    defined = dict(re.findall(r"#define MINISGL_(OK|ERR_\w+) (\d+)", _source_without_comments()))
    assert {name: int(code) for name, code in defined.items()} == {
        name: getattr(abi, name)
        for name in ("OK", "ERR_NOMEM", "ERR_SHAPE") + ("ERR_UNSUPPORTED", "ERR_POSITION")
    }

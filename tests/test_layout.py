"""Architecture rules of the source tree, checked by reading it with ``ast`` (nothing is imported).

The packages form layers, lowest first: kernels, models, engine, server. A module may import its
own layer and the layers below it, never one above; bench, the client side beside the server, may
import all four, and nothing outside bench imports bench (tests/ is not checked). Every import
counts wherever it is written: at the top, inside a function, under ``if TYPE_CHECKING:``,
absolute or relative. Files must not import each other in a cycle; no function or method (tests
included) runs over 80 lines, Triton kernels (``@triton.jit``) excepted; and every package's
``__init__.py`` opens with a docstring that says what the package may import.

Inside engine, two rooms: ``engine/core`` is pure Python (the standard library, itself and
``models.kv_spec``: no torch, no numpy), and ``engine/worker`` does not reach back into the
engine's hub (only ``engine.core``, ``engine.worker``, models and kernels). The C++ CPU kernels
(``kernels/csrc``) are a library: x86 intrinsics are named only in its vector headers, no file
runs over 400 lines and no function over 80. The Triton attention kernels are a package split
by job (``kernels/triton_attention``): none of its files runs over 400 lines either.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Layer of each source package; a file may import a package whose layer is <= its own.
# bench sits above server, so it may import everything and nothing else may import it.
LAYERS: dict[str, int] = {"kernels": 0, "models": 1, "engine": 2, "server": 3, "bench": 4}
CORE_PACKAGES = ("kernels", "models", "engine", "server")
MAX_FUNCTION_LINES = 80
# What engine/core may import besides the standard library.
CORE_ROOM_IMPORTS = ("engine.core", "models.kv_spec")
# What engine/worker may import of the engine.
WORKER_ROOM_ENGINE_IMPORTS = ("engine.core", "engine.worker")
CSRC = "kernels/csrc"
# The files written for the instruction set: float vectors, and the byte dot products of the
# quantized formats.
VECTOR_HEADERS = ("vec.h", "qdot.h")
MAX_CPP_FILE_LINES = 400
ONLY = " and ".join(VECTOR_HEADERS)
INTRINSIC = re.compile(r"\b_mm(?:256|512)?_\w+|\b__m(?:128|256|512)[a-z]*\b|<[a-z]*intrin\.h>")
# The Triton paged-attention kernels, a package split by job.
TRITON_ATTENTION = "kernels/triton_attention"
MAX_TRITON_ATTENTION_FILE_LINES = 400


@dataclass(frozen=True)
class Import:
    """One imported module: absolute dotted name (relative imports resolved) and the names
    taken from it by ``from ... import`` (empty for ``import a.b``)."""

    line: int
    module: str
    names: tuple[str, ...]


def find_root(start: Path) -> Path:
    """The nearest folder at or above ``start`` that holds ``pyproject.toml``."""
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml at or above {start}")


@pytest.fixture(scope="module")
def root() -> Path:
    return find_root(Path(__file__).resolve().parent)


def relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def python_files(root: Path, folders: Iterable[str] = LAYERS) -> list[Path]:
    """Every ``.py`` file under the given top-level folders; missing folders are skipped."""
    files: list[Path] = []
    for folder in folders:
        if (root / folder).is_dir():
            files += (
                path
                for path in (root / folder).rglob("*.py")
                if "__pycache__" not in path.relative_to(root).parts
            )
    return sorted(files)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports_in(root: Path, path: Path) -> list[Import]:
    """Every import statement of the file, wherever it is, in line order."""
    # The package a relative import starts from: the folder of a module, or the package itself
    # for an __init__.py (engine/x.py -> engine, engine/__init__.py -> engine).
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    found: list[Import] = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found += (Import(node.lineno, alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: max(0, len(package) - node.level + 1)] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append(Import(node.lineno, module, tuple(a.name for a in node.names)))
    return sorted(found, key=lambda imp: (imp.line, imp.module))


def upward_imports(root: Path) -> list[str]:
    """Imports that point up the layers, or into bench from outside it."""
    violations: list[str] = []
    for path in python_files(root):
        source = path.relative_to(root).parts[0]
        for imp in imports_in(root, path):
            target = imp.module.split(".")[0]
            if target in LAYERS and LAYERS[target] > LAYERS[source]:
                violations.append(
                    f"{relative(root, path)}:{imp.line} imports {imp.module} "
                    f"({source} may not import {target})"
                )
    return violations


def module_file(root: Path, parts: list[str]) -> Path | None:
    """The file of a project module: a/b/c.py, else a/b/c/__init__.py; None if neither."""
    if not parts or parts[0] not in LAYERS:
        return None
    for candidate in (root.joinpath(*parts[:-1], parts[-1] + ".py"), root.joinpath(*parts)):
        if candidate.suffix != ".py":
            candidate = candidate / "__init__.py"
        if candidate.is_file():
            return candidate
    return None


def import_targets(root: Path, imp: Import) -> set[Path]:
    """Files an import reaches: ``from a.b import x`` means a/b/x.py if that submodule exists,
    else a/b itself. Parent packages' ``__init__.py`` files are not added."""
    parts = imp.module.split(".") if imp.module else []
    if not imp.names:
        target = module_file(root, parts)
        return {target} if target else set()
    targets: set[Path] = set()
    for name in imp.names:
        target = (module_file(root, [*parts, name]) if name != "*" else None) or module_file(
            root, parts
        )
        if target:
            targets.add(target)
    return targets


def import_graph(root: Path) -> dict[Path, set[Path]]:
    """File -> the project files it imports (self-imports left out)."""
    graph: dict[Path, set[Path]] = {}
    for path in python_files(root):
        graph[path] = set()
        for imp in imports_in(root, path):
            graph[path] |= import_targets(root, imp) - {path}
    return graph


def strongly_connected(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """Tarjan's algorithm with an explicit stack (no recursion)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    components: list[list[Path]] = []

    def visit(node: Path) -> Iterator[Path]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(graph.get(node, ())))

    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, visit(start))]
        while work:
            node, edges = work[-1]
            for successor in edges:
                if successor not in index:
                    work.append((successor, visit(successor)))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[Path] = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
    return components


def import_cycles(root: Path) -> list[list[str]]:
    """Groups of two or more files that import each other, directly or round a loop."""
    cycles = [c for c in strongly_connected(import_graph(root)) if len(c) > 1]
    return sorted([relative(root, path) for path in cycle] for cycle in cycles)


def is_triton_jit(decorator: ast.expr) -> bool:
    """``@triton.jit``, ``@triton.jit(...)``, ``@jit`` or ``@jit(...)``."""
    if isinstance(decorator, ast.Call):
        decorator = decorator.func
    if isinstance(decorator, ast.Name):
        return decorator.id == "jit"
    return (
        isinstance(decorator, ast.Attribute)
        and decorator.attr == "jit"
        and isinstance(decorator.value, ast.Name)
        and decorator.value.id == "triton"
    )


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions and methods (nested ones too) in the packages and tests/ longer than ``limit``
    lines, counted from the ``def`` line; Triton kernels are exempt."""
    found: list[tuple[str, int, str]] = []
    for path in python_files(root, (*LAYERS, "tests")):
        for node in ast.walk(parse(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any(is_triton_jit(d) for d in node.decorator_list):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append((relative(root, path), node.lineno, f"{node.name} ({length} lines)"))
    return [f"{path}:{line} {what}" for path, line, what in sorted(found)]


def package_docstring_problems(root: Path) -> list[str]:
    """Packages whose ``__init__.py`` lacks a docstring saying what the package may import."""
    problems: list[str] = []
    for package in LAYERS:
        init = root / package / "__init__.py"
        if not init.is_file():
            continue
        doc = (ast.get_docstring(parse(init)) or "").strip()
        if not doc:
            problems.append(f"{package}/__init__.py has no module docstring")
        elif "import" not in doc.lower():
            problems.append(f"{package}/__init__.py docstring does not say what it may import")
    return problems


def within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def room_violations(root: Path) -> list[str]:
    """Imports out of engine/core other than the standard library, itself and models.kv_spec;
    imports from engine/worker into the engine's hub."""
    found: list[str] = []
    for path in python_files(root, ["engine"]):
        room = path.relative_to(root).parts[1] if len(path.relative_to(root).parts) > 2 else ""
        for imp in imports_in(root, path):
            top = imp.module.split(".")[0]
            where = f"{relative(root, path)}:{imp.line} imports {imp.module}"
            if room == "core" and not (
                within(imp.module, CORE_ROOM_IMPORTS) or top in sys.stdlib_module_names
            ):
                allowed = ", ".join(CORE_ROOM_IMPORTS)
                found.append(f"{where} (engine/core: standard library, {allowed})")
            if room == "worker" and top == "engine":
                if not within(imp.module, WORKER_ROOM_ENGINE_IMPORTS):
                    found.append(f"{where} (engine/worker may not import the engine's hub)")
    return found


def cpp_files(root: Path) -> list[Path]:
    folder = root / CSRC
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.suffix in (".h", ".hpp", ".cpp", ".cc"))


def cpp_code(text: str, directives: bool = False) -> str:
    """C++ source with comments and string and char literals blanked out (and preprocessor
    lines too, unless ``directives``), newlines kept so that line numbers stay."""
    literals = r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
    pattern = literals if directives else literals + r"|^[ \t]*#[^\n]*"
    return re.sub(pattern, lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S | re.M)


CONTROL = re.compile(r"\b(?:if|for|while|switch|catch|do|else)\s*(?:\(.*\))?\s*$", re.S)


def cpp_functions(text: str) -> list[tuple[int, int]]:
    """(first line, lines) of each outermost function body: a brace after a ``)`` (and
    qualifiers or an initializer list) that is not a control statement's, outside any other
    function. The count starts at the signature's first line."""
    code = cpp_code(text)
    found: list[tuple[int, int]] = []
    depth_in_function = 0  # brace depth inside the current outermost function, 0: outside
    header_start = start = 0
    for i, ch in enumerate(code):
        if ch in ";}" and not depth_in_function:
            header_start = i + 1
        if ch == "{":
            if depth_in_function:
                depth_in_function += 1
                continue
            header = code[header_start:i].strip()
            body_like = re.search(r"\)\s*(?:const|noexcept|override|final|->[^{]*|:[^{]*|\s)*$",
                                  header)  # fmt: skip
            if body_like and not CONTROL.search(header):
                depth_in_function = 1
                first = (
                    header_start + len(code[header_start:i]) - len(code[header_start:i].lstrip())
                )
                start = code.count("\n", 0, first) + 1
            header_start = i + 1
        elif ch == "}" and depth_in_function:
            depth_in_function -= 1
            if not depth_in_function:
                end = code.count("\n", 0, i) + 1
                found.append((start, end - start + 1))
                header_start = i + 1
    return found


def cpp_library_problems(root: Path) -> list[str]:
    """Intrinsics outside the vector headers, files over 400 lines, functions over 80."""
    problems: list[str] = []
    for path in cpp_files(root):
        text = path.read_text(encoding="utf-8")
        name = relative(root, path)
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_CPP_FILE_LINES:
            problems.append(f"{name}: {lines} lines (at most {MAX_CPP_FILE_LINES})")
        if path.name not in VECTOR_HEADERS:
            code = cpp_code(text, directives=True)
            for m in INTRINSIC.finditer(code):
                line = code.count("\n", 0, m.start()) + 1
                problems.append(f"{name}:{line} names {m.group()} (only {ONLY} may)")
        for line, length in cpp_functions(text):
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{name}:{line} a function of {length} lines")
    return problems


def triton_attention_problems(root: Path) -> list[str]:
    """Files of the Triton attention package over 400 lines."""
    problems: list[str] = []
    for path in python_files(root, [TRITON_ATTENTION]):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_TRITON_ATTENTION_FILE_LINES:
            limit = MAX_TRITON_ATTENTION_FILE_LINES
            problems.append(f"{relative(root, path)}: {lines} lines (at most {limit})")
    return problems


def missing_core_packages(root: Path) -> list[str]:
    """Core packages that are absent or hold no Python file (so the checks would be vacuous)."""
    return [package for package in CORE_PACKAGES if not python_files(root, [package])]


def test_imports_point_down_the_layers(root: Path) -> None:
    assert not missing_core_packages(root), f"packages not found: {missing_core_packages(root)}"
    violations = upward_imports(root)
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def test_no_import_cycles_between_files(root: Path) -> None:
    assert not missing_core_packages(root), f"packages not found: {missing_core_packages(root)}"
    cycles = import_cycles(root)
    assert not cycles, "files that import each other:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_no_function_over_80_lines_outside_triton_kernels(root: Path) -> None:
    assert not missing_core_packages(root), f"packages not found: {missing_core_packages(root)}"
    offenders = long_functions(root, MAX_FUNCTION_LINES)
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_every_package_opens_with_a_docstring_of_what_it_may_import(root: Path) -> None:
    missing = [p for p in CORE_PACKAGES if not (root / p / "__init__.py").is_file()]
    assert not missing, f"packages without __init__.py: {missing}"
    problems = package_docstring_problems(root)
    assert not problems, "package docstrings:\n" + "\n".join(problems)


def test_engine_core_is_pure_python_and_the_worker_stays_out_of_the_hub(root: Path) -> None:
    assert python_files(root, ["engine/core"]) and python_files(root, ["engine/worker"])
    violations = room_violations(root)
    assert not violations, "imports across the engine's rooms:\n" + "\n".join(violations)


def test_cpu_kernels_are_a_library_of_small_files(root: Path) -> None:
    files = cpp_files(root)
    assert {p.name for p in files} >= set(VECTOR_HEADERS), f"no {VECTOR_HEADERS} under {CSRC}"
    problems = cpp_library_problems(root)
    assert not problems, "C++ kernel library:\n" + "\n".join(problems)


def test_triton_attention_is_a_package_of_small_files(root: Path) -> None:
    init = root / TRITON_ATTENTION / "__init__.py"
    assert init in python_files(root, [TRITON_ATTENTION]), f"no package {TRITON_ATTENTION}"
    problems = triton_attention_problems(root)
    assert not problems, "Triton attention package:\n" + "\n".join(problems)


# --- The checker checked on small fake trees, so the tests above cannot pass vacuously. ---


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")


def function_source(name: str, lines: int, decorators: Iterable[str] = ()) -> str:
    """A function ``lines`` long from its ``def`` line, below the given decorator lines."""
    body = "    x = 1\n" * (lines - 2) + "    return x\n"
    return "".join(f"@{d}\n" for d in decorators) + f"def {name}():\n{body}\n\n"


LAYERED_TREE = {
    "pyproject.toml": "",
    "kernels/__init__.py": '"""The bottom layer: it imports nothing of the project."""\n',
    "kernels/a.py": "import os\n\n\ndef f():\n    from engine.x import y\n\n    return os, y\n",
    "models/__init__.py": '"""Models: may import kernels."""\n',
    "models/m.py": (
        "from typing import TYPE_CHECKING\n\nimport enginex\nimport serverless.api\n"
        "from kernels import a\n\nfrom . import n\nfrom .n import g\n\n"
        "if TYPE_CHECKING:\n    from kernels.a import f\n"
    ),
    "models/n.py": "import kernels.a\n\n\ndef g():\n    return kernels.a\n",
    "engine/__init__.py": '"""Engine: may import models, kernels."""\nfrom engine.x import y\n',
    "engine/x.py": "from engine import z\n\ny = 1\n",
    "engine/z.py": "from engine.x import y\n",
    "engine/w.py": "import models.m\nfrom . import x\nfrom .x import y\nfrom .z import *\n",
    "engine/sub/__init__.py": "from .deep import q\n",
    "engine/sub/deep.py": "from .. import x\nfrom ..w import y\n\nq = 1\n",
    "server/__init__.py": '"""Server: may import engine, models, kernels."""\n',
    "server/s.py": "from engine.x import y\nfrom models import m\nimport bench_tools\n",
    "bench/__init__.py": '"""Client side: imports anything; nothing imports it."""\n',
    "bench/b.py": "import server.s\nfrom server import s\nfrom kernels.a import f\n",
    "tests/test_fake.py": "import bench.b\n",
    "scripts/tool.py": "import bench.b\n",
}


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    write_tree(tmp_path, LAYERED_TREE)
    assert find_root(tmp_path / "engine" / "sub") == tmp_path
    assert not missing_core_packages(tmp_path)
    assert upward_imports(tmp_path) == [
        "kernels/a.py:5 imports engine.x (kernels may not import engine)"
    ]
    assert import_cycles(tmp_path) == [["engine/x.py", "engine/z.py"]]
    graph = {
        relative(tmp_path, path): {relative(tmp_path, target) for target in targets}
        for path, targets in import_graph(tmp_path).items()
    }
    assert graph["kernels/a.py"] == {"engine/x.py"}
    assert graph["models/m.py"] == {"kernels/a.py", "models/n.py"}
    assert graph["engine/w.py"] == {"models/m.py", "engine/x.py", "engine/z.py"}
    assert graph["engine/sub/__init__.py"] == {"engine/sub/deep.py"}
    assert graph["engine/sub/deep.py"] == {"engine/x.py", "engine/w.py"}
    assert graph["engine/__init__.py"] == {"engine/x.py"}
    assert graph["bench/b.py"] == {"server/s.py", "kernels/a.py"}


def test_the_checker_sees_long_functions_bad_docstrings_and_imports_of_bench(
    tmp_path: Path,
) -> None:
    kernels = (
        "import functools\n\nimport triton\nfrom triton import jit\n\n\n"
        + function_source("kernel", 120, ["triton.autotune(configs=[])", "triton.jit"])
        + function_source("kernel2", 95, ["jit(do_not_specialize=[0])"])
        + function_source("fits", 80, ["functools.cache", "functools.wraps(print)"])
        + "class C:\n    async "
        + function_source("method", 81).replace("\n", "\n    ").rstrip(" ")
    )
    method_line = kernels.splitlines().index("    async def method():") + 1
    write_tree(
        tmp_path,
        {
            "pyproject.toml": "",
            "kernels/__init__.py": "import os\n",
            "kernels/k.py": kernels,
            "models/__init__.py": '"""Models of the server."""\n',
            "server/__init__.py": '"""May import models and kernels."""\n',
            "server/s.py": "def f():\n    import bench.b\n",
            "bench/__init__.py": '"""Imports anything; nothing imports it."""\n',
            "bench/b.py": "import server.s\nimport kernels.k\n",
            "tests/test_x.py": function_source("test_long", 81),
        },
    )
    assert missing_core_packages(tmp_path) == ["engine"]
    assert upward_imports(tmp_path) == [
        "server/s.py:2 imports bench.b (server may not import bench)"
    ]
    assert import_cycles(tmp_path) == [["bench/b.py", "server/s.py"]]
    assert long_functions(tmp_path, MAX_FUNCTION_LINES) == [
        f"kernels/k.py:{method_line} method (81 lines)",
        "tests/test_x.py:1 test_long (81 lines)",
    ]
    assert package_docstring_problems(tmp_path) == [
        "kernels/__init__.py has no module docstring",
        "models/__init__.py docstring does not say what it may import",
    ]


CPP_TREE = {
    "pyproject.toml": "",
    "kernels/csrc/cpu/vec.h": "#include <immintrin.h>\ninline __m256 add(__m256 a) { return a; }\n",
    "kernels/csrc/cpu/ops.cpp": (
        '#include <immintrin.h>\n#include "vec.h"\n'
        "// _mm256_add_ps in a comment is fine\n"
        "struct S {\n  int f() const { return 1; }\n};\n"
        "namespace k {\nvoid g(int n) {\n"
        + "  if (n) {\n    n++;\n  }\n" * 27
        + '  auto s = "_mm_add_ps {";\n  __m256 v = _mm256_setzero_ps();\n}\n}  // namespace k\n'
    ),
    "kernels/csrc/cpu/big.h": "int x;\n" * 401,
    "engine/core/a.py": (
        "import heapq\nimport torch\nfrom engine.core import b\nfrom engine import args\n"
    ),
    "engine/core/b.py": "from models.kv_spec import KVCacheGroup\nfrom models.config import C\n",
    "engine/worker/w.py": "import torch\nfrom engine.core.b import x\nfrom engine.args import A\n",
    "engine/x.py": "import torch\n",
}


def test_the_checker_sees_impure_core_imports_and_a_poor_cpp_library(tmp_path: Path) -> None:
    write_tree(tmp_path, CPP_TREE)
    assert room_violations(tmp_path) == [
        "engine/core/a.py:2 imports torch (engine/core: standard library, engine.core, "
        "models.kv_spec)",
        "engine/core/a.py:4 imports engine (engine/core: standard library, engine.core, "
        "models.kv_spec)",
        "engine/core/b.py:2 imports models.config (engine/core: standard library, engine.core, "
        "models.kv_spec)",
        "engine/worker/w.py:3 imports engine.args (engine/worker may not import the engine's hub)",
    ]
    # ``void g(int n) {`` on line 8: 1 + 27 * 3 + 3 lines to its closing brace.
    assert cpp_functions(CPP_TREE["kernels/csrc/cpu/ops.cpp"]) == [(5, 1), (8, 85)]
    assert cpp_library_problems(tmp_path) == [
        "kernels/csrc/cpu/big.h: 401 lines (at most 400)",
        "kernels/csrc/cpu/ops.cpp:1 names <immintrin.h> (only vec.h and qdot.h may)",
        "kernels/csrc/cpu/ops.cpp:91 names __m256 (only vec.h and qdot.h may)",
        "kernels/csrc/cpu/ops.cpp:91 names _mm256_setzero_ps (only vec.h and qdot.h may)",
        "kernels/csrc/cpu/ops.cpp:8 a function of 85 lines",
    ]


def test_the_checker_sees_a_long_file_of_the_triton_attention_package(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pyproject.toml": "",
            "kernels/triton_attention/__init__.py": "x = 1\n" * 400,
            "kernels/triton_attention/big.py": "x = 1\n" * 401,
            "kernels/triton_rope.py": "x = 1\n" * 401,
        },
    )
    assert triton_attention_problems(tmp_path) == [
        "kernels/triton_attention/big.py: 401 lines (at most 400)"
    ]

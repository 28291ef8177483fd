"""Mutants of one function's source: standard operators, and the ones this engine's bugs are made of.

Each operator proposes a replacement for one AST node's exact source span (:class:`Mutant`);
:func:`mutate_source` splices it in with a fired marker, keeping every other line in place. Not a mutation
library's operators, because the mutant must be one small diff for the source-patch path and the engine
needs ``page`` and ``align``. The operators: docs/modules.md.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from harness.changes.lines import source_lines

#: The marker module a mutant calls (written beside the scratch ``sglang/``, first on the path).
MARKER_MODULE = "_harness_mutant"

_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


@dataclass(frozen=True)
class Mutant:
    """One mutant: where, what, and the replacement of one node's source span.

    Attributes:
        id: ``<module>:<function>:<line>:<n>`` (unique within a run).
        path: the file, relative to the tree (``sglang/...``).
        function: the function's qualified name.
        operator: the operator's name (see the module docstring).
        line, col, end_line, end_col: the replaced span (lines 1-based, columns 0-based, as ``ast`` gives).
        old: the span's original text.
        new: its replacement (an expression, or ``""`` for a removed statement).
        statement: the span is a whole statement (removed ones are replaced by the marker call).
    """

    id: str
    path: str
    function: str
    operator: str
    line: int
    col: int
    end_line: int
    end_col: int
    old: str
    new: str
    statement: bool = False

    def describe(self) -> str:
        """One line: ``compare: line 564: `seq_len <= 0` -> `seq_len < 0```."""
        old = " ".join(self.old.split())
        old = old if len(old) <= 80 else old[:77] + "..."
        if self.statement:
            return f"{self.operator}: line {self.line}: removed `{old}`"
        return f"{self.operator}: line {self.line}: `{old}` -> `{self.new}`"


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def _page_expr(fn: ast.AST) -> tuple[str, int] | None:
    """The page-size expression the function reads (``page_size``, ``x.page_size``) and the first line
    from which it is defined (a local ``page_size`` only after its assignment: before it, ``± page``
    would raise, a mutant any test kills without telling anything)."""
    args = fn.args  # type: ignore[attr-defined]
    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    if "page_size" in params:
        return "page_size", 0
    stores = [
        n.lineno
        for n in ast.walk(fn)
        if isinstance(n, ast.Name) and n.id == "page_size" and isinstance(n.ctx, ast.Store)
    ]
    if stores:
        return "page_size", min(stores) + 1
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and node.attr == "page_size":
            return _text(node), 0
    return None


def _is_floor_align(node: ast.AST) -> tuple[ast.AST, ast.AST] | None:
    """``(a // p) * p`` -> ``(a, p)``."""
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.FloorDiv)
        and _text(node.left.right) == _text(node.right)
    ):
        return node.left.left, node.right
    return None


def _is_ceil_align(node: ast.AST) -> tuple[ast.AST, ast.AST] | None:
    """``-(-a // p) * p`` -> ``(a, p)``."""
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and isinstance(node.left, ast.UnaryOp)
        and isinstance(node.left.op, ast.USub)
        and isinstance(node.left.operand, ast.BinOp)
        and isinstance(node.left.operand.op, ast.FloorDiv)
        and isinstance(node.left.operand.left, ast.UnaryOp)
        and isinstance(node.left.operand.left.op, ast.USub)
        and _text(node.left.operand.right) == _text(node.right)
    ):
        return node.left.operand.left.operand, node.right
    return None


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn``'s body, not those of a function, class or lambda nested in it (they are
    functions of their own: ``harness mutate --function`` names them)."""
    out: list[ast.AST] = []
    for stmt in fn.body:  # type: ignore[attr-defined]
        todo = [stmt]  # breadth first within each statement, the statements in source order
        while todo:
            node = todo.pop(0)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            out.append(node)
            todo.extend(ast.iter_child_nodes(node))
    return out


def _proposals(fn: ast.AST) -> list[tuple[str, ast.AST, str, bool]]:
    """``(operator, node, replacement, is_statement)`` for every mutation of ``fn``'s body."""
    out: list[tuple[str, ast.AST, str, bool]] = []
    page = _page_expr(fn)
    for node in _own_nodes(fn):
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            swapped = ast.BinOp(node.left, _ARITH[type(node.op)](), node.right)
            out.append(("arith", node, _text(swapped), False))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            swapped_cmp = ast.Compare(node.left, [_COMPARE[type(node.ops[0])]()], node.comparators)
            out.append(("compare", node, _text(swapped_cmp), False))
        if isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            out.append(("boolean", node, _text(ast.BoolOp(other, node.values)), False))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(("boolean", node, _text(node.operand), False))
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 1 << 20:
            out += [("number", node, repr(node.value + 1), False), ("number", node, repr(node.value - 1), False)]
        if isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append(("constant", node, repr(not node.value), False))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
            other_fn = "min" if node.func.id == "max" else "max"
            out.append(("minmax", node, _text(ast.Call(ast.Name(other_fn), node.args, node.keywords)), False))
        if (aligned := _is_floor_align(node)) is not None:
            a, p = aligned
            out.append(("align", node, f"-(-({_text(a)}) // {_text(p)}) * {_text(p)}", False))
        elif (aligned := _is_ceil_align(node)) is not None:
            a, p = aligned
            out.append(("align", node, f"(({_text(a)}) // {_text(p)}) * {_text(p)}", False))
        if (
            page
            and isinstance(node, (ast.Assign, ast.AugAssign, ast.Return))
            and node.value is not None
            and not isinstance(node.value, (ast.Constant, ast.Tuple, ast.Call))
            and node.lineno >= page[1]
            and _text(node.value) != page[0]
        ):
            value = node.value
            out += [
                ("page", value, f"({_text(value)}) + {page[0]}", False),
                ("page", value, f"({_text(value)}) - {page[0]}", False),
            ]
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            out.append(("call", node, "", True))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and isinstance(node, ast.stmt):
            out.append(("assign", node, "", True))
    return out


def find_function(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The function ``qualname`` (``Class.method`` or ``function``) of a module's AST."""
    scope: list[ast.stmt] = tree.body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        found = None
        for node in scope:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part:
                found = node
                break
        if found is None:
            return None
        if i == len(parts) - 1:
            return found if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        scope = found.body
    return None


def mutants_of(source: str, path: str, qualname: str) -> list[Mutant]:
    """Every mutant of function ``qualname`` in ``source`` that compiles and differs from the original.

    Raises:
        LookupError: the module has no function ``qualname``.
    """
    tree = ast.parse(source)
    fn = find_function(tree, qualname)
    if fn is None:
        raise LookupError(f"{path} has no function {qualname}")
    first, last = fn.lineno - 1, fn.end_lineno or fn.lineno  # type: ignore[attr-defined]

    def function_ast(text: str) -> str:
        # Only the function's own lines are parsed (a mutant keeps every line number): a whole module
        # of thousands of lines parsed once per mutant is most of the time a large file's mutants take.
        # A method is parsed inside an ``if`` block (its indentation kept: a docstring line at column
        # 0 would defeat any dedent).
        body = "".join(source_lines(text)[first:last])
        return ast.dump(ast.parse(f"if 1:\n{body}" if body[:1] in " \t" else body))

    original = function_ast(source)
    out: list[Mutant] = []
    seen: set[tuple[int, int, int, int, str]] = set()
    for operator, node, new, statement in _proposals(fn):
        span = (node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0)  # type: ignore[attr-defined]
        if (*span, new) in seen:
            continue
        seen.add((*span, new))
        old = ast.get_source_segment(source, node) or ""
        module = path.removesuffix(".py").replace("/", ".")
        m = Mutant(
            f"{module}:{qualname}:{span[0]}:{len(out) + 1}", path, qualname, operator, *span, old, new, statement
        )
        try:
            changed = function_ast(mutate_source(source, m, marker=False)) != original
            function_ast(mutate_source(source, m))  # with its marker too (it must compile where it sits)
        except SyntaxError:
            continue
        if changed:
            out.append(m)
    return out


def mutate_source(source: str, m: Mutant, marker: bool = True) -> str:
    """``source`` with mutant ``m`` spliced in; with ``marker``, the replacement calls
    ``_harness_mutant.hit(id, value)`` (it records that the mutant ran and returns the value). The
    replaced span keeps its line count (extra lines become blank lines inside the parentheses), so
    every other line keeps its number."""
    lines = source_lines(source)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln.encode("utf-8")))
    raw = source.encode("utf-8")
    start = offsets[m.line - 1] + m.col
    end = offsets[m.end_line - 1] + m.end_col
    pad = "\n" * (m.end_line - m.line)
    if m.statement:
        new = f"__import__({MARKER_MODULE!r}).hit({m.id!r}, None){';' if pad else ''}" if marker else "pass"
        new += pad.replace("\n", "\n" + " " * m.col) if pad else ""
    elif marker:
        new = f"__import__({MARKER_MODULE!r}).hit({m.id!r}, ({m.new}{pad}))"
    else:
        new = f"({m.new}{pad})"
    return (raw[:start] + new.encode("utf-8") + raw[end:]).decode("utf-8")


MARKER_SOURCE = '''"""Written by the harness beside a mutated sglang: records that a mutant's code ran."""
import os

_seen = set()


def hit(mutant, value):
    if mutant not in _seen:
        _seen.add(mutant)
        path = os.environ.get("HARNESS_FAULT_FIRED")
        if path:
            with open(path, "a") as f:
                f.write(mutant + "\\n")
    return value
'''

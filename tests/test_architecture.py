"""The package's import structure (docs/architecture.md): no import cycle between files or packages.

Every ``import`` statement counts, including those inside functions: a lazy import is still a
dependency. A package is a folder (its modules with it); a module at the top of ``stemlm/`` stands
alone. ``__main__`` modules are entry points that call the CLI, above everything.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# No package may import a package that imports it back (the study evaluates in-process, without the CLI).
ALLOWED_PACKAGE_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for f in (ROOT / "stemlm").rglob("*.py"):
        if f.name == "__main__.py":
            continue
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the stemlm modules it imports (``from a import b`` counts ``a.b`` when that is a module)."""
    edges = {}
    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name.startswith("stemlm") and name != mod:
                    found.add(name)
        edges[mod] = found
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(mod: str, mods: dict[str, Path]) -> str:
    if mods[mod].name == "__init__.py" or mod.count(".") == 1:
        return mod
    return mod.rpartition(".")[0]


def test_no_import_cycle_between_files():
    mods = _modules()
    edges = _imports(mods)
    # a submodule may import its own package's __init__ (Python's layout); any other loop is a cycle
    graph = {m: {t for t in ts if not (mods[t].name == "__init__.py" and m.startswith(t + "."))} for m, ts in edges.items()}
    assert _cycles(graph) == []


def test_no_import_cycle_between_packages():
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, targets in _imports(mods).items():
        a = _package(mod, mods)
        for t in targets:
            b = _package(t, mods)
            nested = a.startswith(b + ".") or b.startswith(a + ".")
            if a != b and not nested and (a, b) not in ALLOWED_PACKAGE_EDGES:
                graph.setdefault(a, set()).add(b)
    assert _cycles(graph) == []


# Comparisons with a string that happens to equal a kind's name but is not one: a key kind
# (``FFNKind.keyed_by``: "token" / "ngram"), an analysis (``stemlm analyze ngram``), a table optimizer.
NOT_KIND_NAMES = {"keyed_by", "what", "table_optimizer"}


def _compared_kind_names(path: Path, kinds: set[str]) -> list[str]:
    """``file:line: expression`` of every comparison (``==``, ``!=``, ``in``) with a kind's name as a string."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(isinstance(o, ast.Attribute) and o.attr in NOT_KIND_NAMES for o in operands):
            continue
        strings = [o for o in operands if isinstance(o, ast.Constant)]
        strings += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts
                    if isinstance(e, ast.Constant)]
        if any(s.value in kinds for s in strings):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_decision_outside_stemlm_ffn_names_a_kind():
    """Code outside ``stemlm/ffn/`` asks a kind for its facts (``ffn_kind(k).is_dense``,
    ``.anneals_to``, ``.routes_by_data`` ...) instead of comparing its name with a string; the
    dense kind's name, where a value is needed, is ``stemlm.ffn.DENSE``."""
    from stemlm.ffn import FFN_KINDS

    found = [hit for f in sorted((ROOT / "stemlm").rglob("*.py")) if "ffn" not in f.relative_to(ROOT).parts[1:2]
             for hit in _compared_kind_names(f, set(FFN_KINDS))]
    assert not found, "kind names compared outside stemlm/ffn/:\n" + "\n".join(found)

#!/usr/bin/env python3
"""The import graph of each crate's modules, and its circles.

A module is a file under `crates/<crate>/src` (`a/mod.rs` is `a`, `a/b.rs` is `a::b`); it imports
another when its code (comments left out) names it through `crate::`, `super::` or `self::` paths,
in `use` items and in expressions alike. Test modules (`tests.rs`, `*_tests.rs`, `#[cfg(test)] mod tests` blocks are not
split out: their file counts as its parent) are left out, as is a child naming its own ancestor's
items that it is declared in (a child always sees its parent). Prints, per crate, each module's
imports and every circle between modules that are not ancestor and descendant; exit status 1 if
there is a circle.

    scripts/import-graph.py [--edges]
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates")
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def modules(src):
    """{module path (tuple): file} of one crate."""
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            if rel and (rel[-1] == "tests" or rel[-1].endswith("_tests")):
                continue
            out[tuple(rel)] = os.path.join(dirpath, f)
    return out


def code_of(text):
    """The text without comments (doc comments name modules without importing them) and
    without its `#[cfg(test)] mod … { … }` block (the last item of a file)."""
    i = text.find("#[cfg(test)]\nmod ")
    text = text if i < 0 else text[:i]
    return re.sub(r"//[^\n]*", "", text)


def resolve(mods, here, kind, parts):
    base = {"crate": (), "self": here, "super": here[:-1]}[kind]
    while parts and parts[0] == "super":
        base, parts = base[:-1], parts[1:]
    path = base
    found = None
    for p in parts:
        path = path + (p,)
        if path in mods:
            found = path
        else:
            break
    return found


def graph(src):
    mods = modules(src)
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        text = code_of(open(f, encoding="utf-8").read())
        # `use super::{a, b::c}` groups: each name after the brace is a path of its own.
        for kind, rest in PATH.findall(text):
            parts = [p for p in rest.split("::") if p]
            target = resolve(mods, m, kind, parts)
            if target is None or target == m:
                continue
            # A child seeing its ancestors, or a parent its children: the module tree itself.
            if target == m[: len(target)] or m == target[: len(m)]:
                continue
            edges[m].add(target)
        for kind, body in re.findall(r"\b(crate|super|self)::\{([^}]*)\}", text):
            for name in re.findall(r"(?:^|,)\s*([A-Za-z_][A-Za-z0-9_]*)", body):
                target = resolve(mods, m, kind, [name])
                if target and target != m and target != m[: len(target)] and m != target[: len(m)]:
                    edges[m].add(target)
    return edges


def circles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "lib"


def main():
    show_edges = "--edges" in sys.argv
    found = 0
    for crate in sorted(os.listdir(ROOT)):
        src = os.path.join(ROOT, crate, "src")
        if not os.path.isdir(src):
            continue
        edges = graph(src)
        cs = circles(edges)
        found += len(cs)
        n = sum(len(v) for v in edges.values())
        print(f"{crate}: {len(edges)} modules, {n} imports between them, {len(cs)} circles")
        if show_edges:
            for m in sorted(edges):
                if edges[m]:
                    print(f"  {name(m)} -> {', '.join(name(t) for t in sorted(edges[m]))}")
        for c in cs:
            print("  circle: " + " <-> ".join(name(m) for m in c))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()

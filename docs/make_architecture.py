"""Draw ``docs/architecture.svg``: the layers of ``deepspeed_ext`` and the imports between
them, read from the sources (nothing is imported).

Usage (from the repository root)::

    python docs/make_architecture.py            # rewrites docs/architecture.svg
    python docs/make_architecture.py --out X.svg

Every import counts, at module level or inside a function. Modules are grouped into
layers by their subpackage (``deepspeed_ext.store.commit`` is in ``store``) or, for the
modules still at the package's top level, by :data:`TOP_LEVEL`; a module found in
neither goes to the band ``unsorted``, so the script draws whatever the tree looks like
while modules move. The picture has one band per layer, lowest first from the bottom, one
box per module, and one arrow per pair of layers labelled with how many module pairs
import across it (below it, ``fn``: how many of them only inside functions). An arrow pointing up
(a lower layer importing a higher one) is drawn red.

The output depends only on the sources, so ``tests/test_architecture_doc.py`` can compare
it with the committed file. Standard library only (no plotting package is installed).
"""

import argparse
import ast
import os
from typing import Dict, List, NamedTuple, Optional, Set, Tuple
from xml.sax.saxutils import escape

PACKAGE = "deepspeed_ext"
DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)

LAYERS: Tuple[Tuple[str, str], ...] = (
    ("runtime", "logging, retries, process groups, private directories, node layout"),
    ("policy", "pure decisions: which experts, who writes what, lost tokens, placement"),
    ("format", "bytes and metadata: files, images, checksums, manifest"),
    ("store", "the save directory's life: claims, latest, commit, catalog, reader"),
    ("engine", "what a DeepSpeed engine holds: RNG, device-to-host copies"),
    ("keeper", "the node's keeper process, its client, its typed jobs"),
    ("modes", "the backends: single-level, two-level, exact recovery; their shared session"),
    ("facade", "MoCCheckpointer, enable_moc_checkpointing"),
    ("tools", "moc-ckpt and moc-plan"),
)
"""Layers, lowest first, with a one-line summary each."""

UNSORTED = "unsorted"

SUBPACKAGES: Dict[str, str] = {
    "runtime": "runtime", "policy": "policy", "format": "format", "store": "store",
    "engine": "engine", "two_level": "modes", "exact": "modes", "peers": "modes",
    "snapshot": "modes", "state": "modes", "planning": "tools", "cli": "tools",
    "keeper": "keeper",
}
"""Subpackage of ``deepspeed_ext`` -> layer of every module in it."""

TOP_LEVEL: Dict[str, str] = {
    "": "facade",  # deepspeed_ext/__init__.py
    "node_layout": "runtime", "private_dir": "runtime",
    "jobs": "keeper", "job_identity": "keeper",  # the keeper's wire format and run binding
    "peers": "modes", "snapshot": "modes", "slot_layouts": "modes", "state": "modes",
    # what the facade's two backends share, and the single-level backend itself: the
    # two-level mode imports session and storage_load, so they sit in its band
    "session": "modes", "storage_load": "modes", "single_level": "modes", "config": "modes",
    "checkpointer": "facade", "patch": "facade",
    "cli": "tools",
}
"""Module at the package's top level (name after ``deepspeed_ext.``) -> layer."""


class Edge(NamedTuple):
    """Imports of one module by another."""
    source: str
    target: str
    module_level: bool  # False: only inside functions or methods


def module_files(root: str = REPO) -> Dict[str, str]:
    """Dotted module name -> source path of every module of the package under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _resolve(name: str, modules: Set[str]) -> Optional[str]:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.AST, module: str, is_package: bool, modules: Set[str]) -> List[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts if is_package else parts[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    # `from pkg import sub` imports the submodule; `from mod import name` the module
    subs = [f"{base}.{alias.name}" for alias in node.names]
    names = [n for n in subs if n in modules]
    if len(names) < len(subs):
        names.append(base)
    return names


def imports_of(path: str, module: str, modules: Set[str]) -> Dict[str, bool]:
    """Package modules ``module`` imports -> True if at least once at module level."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    found: Dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for name in _imported_names(node, module, is_package, modules):
            target = _resolve(name, modules)
            if target is not None and target != module:
                found[target] = found.get(target, False) or not in_function
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def import_edges(root: str = REPO) -> Tuple[List[str], List[Edge]]:
    """All modules of the package and every import between two of them, sorted."""
    files = module_files(root)
    modules = set(files)
    edges = [Edge(m, t, top) for m in sorted(files)
             for t, top in sorted(imports_of(files[m], m, modules).items())]
    return sorted(files), edges


def layer_of(module: str) -> str:
    """The layer name of a package module (``unsorted`` when no mapping knows it)."""
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    head = rel.split(".")[0]
    if "." in rel:
        return SUBPACKAGES.get(head, UNSORTED)
    if rel in TOP_LEVEL:
        return TOP_LEVEL[rel]
    return SUBPACKAGES.get(head, UNSORTED)


def layer_names(modules: List[str]) -> List[str]:
    """Bands lowest first; ``unsorted`` on top, only when some module is in it."""
    names = [name for name, _ in LAYERS]
    if any(layer_of(m) == UNSORTED for m in modules):
        names.append(UNSORTED)
    return names


class Crossing(NamedTuple):
    """All imports from one layer into another."""
    source: str
    target: str
    count: int
    function_only: int


def crossings(edges: List[Edge]) -> List[Crossing]:
    """One record per ordered pair of different layers, sorted by (source, target)."""
    tally: Dict[Tuple[str, str], List[int]] = {}
    for e in edges:
        pair = (layer_of(e.source), layer_of(e.target))
        if pair[0] == pair[1]:
            continue
        counts = tally.setdefault(pair, [0, 0])
        counts[0] += 1
        counts[1] += 0 if e.module_level else 1
    return [Crossing(s, t, c, f) for (s, t), (c, f) in sorted(tally.items())]


# drawing ------------------------------------------------------------------------------

BOX_W, BOX_H, GAP = 168, 22, 8
LABEL_W = 170  # left column: the layer's name and count
PER_ROW = 6
BAND_PAD = 10
COLUMN_W = 34  # one arrow column, room for its label
FONT = "font-family='DejaVu Sans Mono, Menlo, monospace'"


def _label(module: str) -> str:
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else "__init__"
    return rel.replace(".", "/")


def _columns(spans: List[Tuple[int, int]]) -> List[int]:
    """Column index per vertical span (top y, bottom y), spans sorted by top: spans
    sharing a column leave at least 4 pixels between them."""
    ends: List[int] = []
    out = []
    for y0, y1 in spans:
        for i, end in enumerate(ends):
            if end + 4 < y0:
                ends[i] = y1
                out.append(i)
                break
        else:
            ends.append(y1)
            out.append(len(ends) - 1)
    return out


def render(modules: List[str], edges: List[Edge]) -> str:
    """The SVG text of the picture."""
    bands = layer_names(modules)
    members = {b: sorted(m for m in modules if layer_of(m) == b) for b in bands}
    summary = dict(LAYERS)
    summary[UNSORTED] = "modules no mapping in docs/make_architecture.py knows yet"
    rows = {b: max(1, -(-len(members[b]) // PER_ROW)) for b in bands}
    heights = {b: 2 * BAND_PAD + 16 + rows[b] * (BOX_H + GAP) for b in bands}
    title_h = 40
    total_h = title_h + sum(heights.values()) + 10
    top: Dict[str, int] = {}
    y = total_h - 10
    for b in bands:  # lowest band at the bottom
        y -= heights[b]
        top[b] = y
    index = {b: i for i, b in enumerate(bands)}
    middle = {b: top[b] + heights[b] // 2 for b in bands}

    def span(c: Crossing) -> Tuple[int, int]:
        # the upper end sits below its band's middle and the lower end above its band's
        # middle, so an arrow ending in a band and one leaving it can share a column
        upper, lower = sorted((c.source, c.target), key=lambda b: -index[b])
        return middle[upper] + 8, middle[lower] - 8

    order = sorted(crossings(edges), key=lambda c: (span(c), c.source, c.target))
    cols = _columns([span(c) for c in order])
    boxes_w = PER_ROW * (BOX_W + GAP)
    arrows_x0 = LABEL_W + boxes_w + 24
    width = arrows_x0 + (max(cols) + 1 if cols else 1) * COLUMN_W + 10
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{total_h}' "
           f"viewBox='0 0 {width} {total_h}' {FONT} font-size='11'>",
           "<defs><marker id='head' markerWidth='8' markerHeight='8' refX='7' refY='4' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#333'/></marker>"
           "<marker id='headup' markerWidth='8' markerHeight='8' refX='7' refY='4' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#c00'/></marker></defs>",
           f"<rect width='{width}' height='{total_h}' fill='white'/>",
           f"<text x='10' y='18' font-size='14' font-weight='bold'>{PACKAGE}: layers, lowest at "
           f"the bottom ({len(modules)} modules, {len(edges)} imports)</text>",
           "<text x='10' y='34'>arrows: module pairs importing across two layers, from the dot "
           "(importer) to the head (imported); fn: of them, only inside functions; red: "
           "upward</text>"]
    for i, b in enumerate(bands):
        fill = "#f4f4f4" if i % 2 == 0 else "#e8eef6"
        if b == UNSORTED:
            fill = "#fff2cc"
        out.append(f"<rect x='0' y='{top[b]}' width='{width}' height='{heights[b]}' "
                   f"fill='{fill}' stroke='#bbb'/>")
        out.append(f"<text x='10' y='{top[b] + 22}' font-size='13' font-weight='bold'>"
                   f"{escape(b)} ({len(members[b])})</text>")
        out.append(f"<text x='{LABEL_W}' y='{top[b] + BAND_PAD + 9}' fill='#555'>"
                   f"{escape(summary[b])}</text>")
        for k, m in enumerate(members[b]):
            bx = LABEL_W + (k % PER_ROW) * (BOX_W + GAP)
            by = top[b] + BAND_PAD + 16 + (k // PER_ROW) * (BOX_H + GAP)
            out.append(f"<rect x='{bx}' y='{by}' width='{BOX_W}' height='{BOX_H}' rx='3' "
                       f"fill='white' stroke='#666'/>")
            out.append(f"<text x='{bx + 5}' y='{by + 15}'>{escape(_label(m))}</text>")
    for c, col in zip(order, cols):
        x = arrows_x0 + col * COLUMN_W + 6
        up = index[c.target] > index[c.source]
        y_top, y_bottom = span(c)
        y0, y1 = (y_bottom, y_top) if up else (y_top, y_bottom)
        colour = "#c00" if up else "#333"
        out.append(f"<circle cx='{x}' cy='{y0}' r='2.5' fill='{colour}'/>")
        out.append(f"<line x1='{x}' y1='{y0}' x2='{x}' y2='{y1}' stroke='{colour}' "
                   f"stroke-width='1.5' marker-end='url(#{'headup' if up else 'head'})'/>")
        my = (y0 + y1) // 2
        out.append(f"<rect x='{x - 14}' y='{my - 10}' width='28' height='{24 if c.function_only else 13}' "
                   f"fill='white' stroke='{colour}' stroke-width='0.5'/>")
        out.append(f"<text x='{x}' y='{my}' fill='{colour}' text-anchor='middle' "
                   f"font-weight='bold'>{c.count}</text>")
        if c.function_only:
            out.append(f"<text x='{x}' y='{my + 11}' fill='{colour}' text-anchor='middle' "
                       f"font-size='9'>{c.function_only}fn</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=REPO, help="repository root holding the package")
    parser.add_argument("--out", default=os.path.join(DOCS, "architecture.svg"))
    args = parser.parse_args(argv)
    modules, edges = import_edges(args.root)
    text = render(modules, edges)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(modules)} modules, {len(edges)} imports, "
          f"{len(crossings(edges))} layer crossings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Draw the repository's layers from its imports, read from the sources (nothing is
imported): ``docs/architecture.svg``, the layers of ``deepspeed_ext``, and
``docs/architecture-trainer.svg``, the trainer's layers (the library, ``megatron``'s
base, data, model and training, and the programs that run them).

Usage (from the repository root)::

    python docs/make_architecture.py        # rewrites both pictures
    python docs/make_architecture.py --out X.svg --trainer-out Y.svg

Every import counts, at module level or inside a function. The programs' folders
(:data:`PROGRAM_FOLDERS`) are on ``sys.path`` when their files run, so a bare import
there (``from benchlib.model import ...``) is looked up in the importing file's own folder
first, then at the repository root, then in the other program folders (a file that puts
one of them on ``sys.path`` imports its modules by bare name).

In the library's picture, modules are grouped into layers by their subpackage
(``deepspeed_ext.store.commit`` is in ``store``) or, for the modules still at the
package's top level, by :data:`TOP_LEVEL`. In the trainer's picture, the library is one
box per library layer and every other module has its box (:func:`trainer_layer_of`). A
module found in no mapping goes to the band ``unsorted``, so the script draws whatever the
tree looks like while modules move. A picture has one band per layer, lowest first from
the bottom, and one arrow per pair of layers labelled with how many module pairs import
across it (below it, ``fn``: how many of them only inside functions). An arrow pointing up
(a lower layer importing a higher one) is drawn red.

The output depends only on the sources, so ``tests/test_architecture_doc.py`` can compare
it with the committed files. Standard library only (no plotting package is installed).
"""

import argparse
import ast
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Set, Tuple
from xml.sax.saxutils import escape

PACKAGE = "deepspeed_ext"
DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)

PROGRAM_FOLDERS: Tuple[str, ...] = ("tools", "scripts", "benchmarks", "experiments")
"""Folders of programs run as ``python <folder>/<name>.py``: the folder is on
``sys.path``, so its files import each other by bare name."""

REPOSITORY: Tuple[str, ...] = (PACKAGE, "megatron", "pretrain_gpt_moe.py") + PROGRAM_FOLDERS
"""What the trainer's picture reads: packages, program folders and the entry point."""

LAYERS: Tuple[Tuple[str, str], ...] = (
    ("runtime", "logging, retries, process groups, private directories, node layout"),
    ("policy", "pure decisions: which experts, who writes what, lost tokens, placement"),
    ("format", "bytes and metadata: files, images, checksums, manifest"),
    ("store", "the save directory's life: claims, latest, commit, catalog, reader"),
    ("engine", "what a DeepSpeed engine holds: RNG, device-to-host copies"),
    ("keeper", "the node's keeper process, its client, its typed jobs"),
    ("modes", "the backends: single-level, two-level, exact recovery; their shared session"),
    ("facade", "MoCCheckpointer, enable_moc_checkpointing"),
    ("tools", "moc-ckpt, moc-plan and the in-job restart supervisor"),
)
"""The library's layers, lowest first, with a one-line summary each."""

TRAINER_LAYERS: Tuple[Tuple[str, str], ...] = (
    ("library", "deepspeed_ext, one box per layer of docs/architecture.svg (modules in it)"),
    ("base", "megatron.errors (the error types every layer raises), megatron.lazy_compile"),
    ("data", "megatron.data: tokenizers, indexed datasets, samplers, preprocessing"),
    ("model", "megatron.model: the GPT-MoE model, tensor parallelism, MoE schedules"),
    ("training", "megatron.training: flags, process, engine set-up, the loop, monitor"),
    ("programs", "pretrain_gpt_moe.py, tools/, scripts/, benchmarks/, experiments/"),
)
"""The trainer's layers, lowest first, with a one-line summary each."""

UNSORTED = "unsorted"

SUBPACKAGES: Dict[str, str] = {
    "runtime": "runtime", "policy": "policy", "format": "format", "store": "store",
    "engine": "engine", "two_level": "modes", "exact": "modes", "peers": "modes",
    "snapshot": "modes", "state": "modes", "planning": "tools", "cli": "tools",
    "keeper": "keeper", "supervisor": "tools", "interop": "tools",
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

MEGATRON: Dict[str, str] = {
    "": "base", "errors": "base", "lazy_compile": "base",
    "data": "data", "model": "model", "training": "training",
}
"""Module or subpackage of ``megatron`` (name after ``megatron.``) -> trainer layer."""


# reading ------------------------------------------------------------------------------

class Edge(NamedTuple):
    """Imports of one module by another."""
    source: str
    target: str
    module_level: bool  # False: only inside functions or methods


class Statement(NamedTuple):
    """One import statement, before it is matched with the repository's modules."""
    line: int
    base: str  # `import base` or `from base import names`; a relative base made absolute
    names: Tuple[str, ...]  # () for `import base`
    in_function: bool
    relative: bool

    def dotted(self) -> List[str]:
        """The names it may import: ``base`` and, for ``from``, ``base.name`` each."""
        return [self.base] + [f"{self.base}.{n}" for n in self.names if n != "*"]


def module_files(root: str = REPO, tops: Tuple[str, ...] = (PACKAGE,)) -> Dict[str, str]:
    """Dotted module name -> source path of every module under ``root``'s ``tops`` (folders,
    or ``.py`` files at the root). A program folder's modules are named after it:
    ``benchmarks/benchlib/model.py`` is ``benchmarks.benchlib.model``."""
    out = {}
    for top in tops:
        if top.endswith(".py"):
            if os.path.isfile(os.path.join(root, top)):
                out[top[:-3]] = os.path.join(root, top)
            continue
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def statements(path: str, module: str) -> List[Statement]:
    """Every import statement of the source file ``path`` (module ``module``), at module
    level or in a function, in the order of the file; relative imports made absolute."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module.split(".")
    if os.path.basename(path) != "__init__.py":
        package = package[:-1]
    out: List[Statement] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend(Statement(node.lineno, a.name, (), in_function, False) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[:len(package) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.append(Statement(node.lineno, base, tuple(a.name for a in node.names),
                                 in_function, bool(node.level)))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return out


def _resolve(name: str, modules: Set[str]) -> Optional[str]:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


class Resolver:
    """Matches import statements with the modules read (``modules``)."""

    def __init__(self, modules: Set[str]):
        self.modules = modules
        # every module and every package above one: the names an import can start with
        self.roots = {".".join(m.split(".")[:i + 1]) for m in modules
                      for i in range(m.count(".") + 1)}

    @staticmethod
    def search_path(module: str) -> List[str]:
        """Prefixes to try, in order, for an absolute import by ``module``: a program's own
        folder first (it is ``sys.path[0]``), the repository root, the other program
        folders (a program that puts one on ``sys.path``); the root only for the rest."""
        folder = module.split(".")[0]
        if folder not in PROGRAM_FOLDERS:
            return [""]
        return [folder + ".", ""] + [f + "." for f in PROGRAM_FOLDERS if f != folder]

    def targets(self, statement: Statement, module: str) -> List[str]:
        """The modules ``statement`` of ``module`` imports: ``from pkg import sub`` imports
        the submodule, ``from mod import name`` the module, ``import a.b`` the module
        ``a.b`` (or the nearest package above it that was read)."""
        prefixes = [""] if statement.relative else self.search_path(module)
        head = statement.base.split(".")[0]
        prefix = next((p for p in prefixes if p + head in self.roots), None)
        if prefix is None:
            return []  # not ours: the standard library, torch, megatron-core ...
        base = prefix + statement.base
        found = [f"{base}.{n}" for n in statement.names if f"{base}.{n}" in self.modules]
        if len(found) < len(statement.names) or not statement.names:
            nearest = _resolve(base, self.modules)
            if nearest is not None:
                found.append(nearest)
        return found


def imports_of(path: str, module: str, modules: Set[str],
               resolver: Optional[Resolver] = None) -> Dict[str, bool]:
    """Modules of ``modules`` that ``module`` imports -> True if at least once at module
    level (``resolver``: one already built for ``modules``)."""
    resolver = resolver or Resolver(modules)
    found: Dict[str, bool] = {}
    for statement in statements(path, module):
        for target in resolver.targets(statement, module):
            if target != module:
                found[target] = found.get(target, False) or not statement.in_function
    return found


def import_edges(root: str = REPO, tops: Tuple[str, ...] = (PACKAGE,)
                 ) -> Tuple[List[str], List[Edge]]:
    """All modules under ``tops`` (default: the library) and every import between two of
    them, sorted; ``tops=REPOSITORY`` reads the whole repository's graph."""
    files = module_files(root, tops)
    modules = set(files)
    resolver = Resolver(modules)
    edges = [Edge(m, t, top) for m in sorted(files)
             for t, top in sorted(imports_of(files[m], m, modules, resolver).items())]
    return sorted(files), edges


# layers -------------------------------------------------------------------------------

def layer_of(module: str) -> str:
    """The library layer of a module of ``deepspeed_ext`` (``unsorted`` when no mapping
    knows it)."""
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    head = rel.split(".")[0]
    if "." in rel:
        return SUBPACKAGES.get(head, UNSORTED)
    if rel in TOP_LEVEL:
        return TOP_LEVEL[rel]
    return SUBPACKAGES.get(head, UNSORTED)


def trainer_layer_of(module: str) -> str:
    """The trainer layer of a module of the repository (``unsorted`` when none fits: a
    new ``megatron`` subpackage, say)."""
    parts = module.split(".")
    if parts[0] == PACKAGE:
        return "library"
    if parts[0] == "pretrain_gpt_moe" or parts[0] in PROGRAM_FOLDERS:
        return "programs"
    if parts[0] == "megatron":
        return MEGATRON.get(parts[1] if len(parts) > 1 else "", UNSORTED)
    return UNSORTED


class Crossing(NamedTuple):
    """All imports from one layer into another."""
    source: str
    target: str
    count: int
    function_only: int


def crossings(edges: List[Edge], layer: Callable[[str], str] = layer_of) -> List[Crossing]:
    """One record per ordered pair of different layers (``layer`` names a module's),
    sorted by (source, target)."""
    tally: Dict[Tuple[str, str], List[int]] = {}
    for e in edges:
        pair = (layer(e.source), layer(e.target))
        if pair[0] == pair[1]:
            continue
        counts = tally.setdefault(pair, [0, 0])
        counts[0] += 1
        counts[1] += 0 if e.module_level else 1
    return [Crossing(s, t, c, f) for (s, t), (c, f) in sorted(tally.items())]


# the two pictures ---------------------------------------------------------------------

Group = Tuple[str, List[str]]
"""Boxes drawn together from a new row: (the name shown left of them, or "", labels)."""


class Picture(NamedTuple):
    """What one picture shows: its bands and how a band's modules become its boxes."""
    title: str
    layers: Tuple[Tuple[str, str], ...]
    layer: Callable[[str], str]
    boxes: Callable[[str, List[str]], List[Group]]  # band, its modules -> its groups
    box_w: int  # at least; wider when a label needs it


def _relative_label(module: str, prefix: str) -> str:
    """``store/commit`` for ``deepspeed_ext.store.commit`` under ``deepspeed_ext``;
    ``__init__`` for the package itself."""
    if not prefix:
        return module.replace(".", "/")
    rel = module[len(prefix) + 1:] if module != prefix else "__init__"
    return rel.replace(".", "/")


def _by_subpackage(modules: List[str], prefix: str) -> List[Group]:
    """The modules under ``prefix`` directly in it first (no name), then one group per
    subpackage (``args/``), each labelled relative to its own package."""
    groups: Dict[str, List[str]] = {}
    for m in modules:
        rel = m[len(prefix) + 1:].split(".") if m != prefix else []
        package = any(o.startswith(m + ".") for o in modules) and m != prefix
        head = rel[0] if rel and (len(rel) > 1 or package) else ""
        inner = f"{prefix}.{head}" if head else prefix
        groups.setdefault(head, []).append(_relative_label(m, inner))
    return [(f"{head}/" if head else "", labels) for head, labels in sorted(groups.items())]


def _library_boxes(band: str, modules: List[str]) -> List[Group]:
    return [("", [_relative_label(m, PACKAGE) for m in modules])]


def _trainer_boxes(band: str, modules: List[str]) -> List[Group]:
    if band == "library":  # one box per library layer, lowest first
        counts = {name: sum(layer_of(m) == name for m in modules)
                  for name in [n for n, _ in LAYERS] + [UNSORTED]}
        return [("", [f"{name} ({n})" for name, n in counts.items() if n])]
    if band == "programs":  # the entry point, then one group per program folder
        groups: Dict[str, List[str]] = {}
        for m in modules:
            folder, _, rel = m.partition(".")
            groups.setdefault(f"{folder}/" if rel else "", []).append(
                rel.replace(".", "/") if rel else folder)
        return sorted(groups.items())
    if band in ("data", "model", "training"):
        return _by_subpackage(modules, f"megatron.{band}")
    return [("", [_relative_label(m, "megatron" if band == "base" else "") for m in modules])]


LIBRARY_PICTURE = Picture(f"{PACKAGE}: layers", LAYERS, layer_of, _library_boxes, 168)
TRAINER_PICTURE = Picture("the trainer: layers", TRAINER_LAYERS, trainer_layer_of,
                          _trainer_boxes, 168)


def layer_names(modules: List[str], picture: Picture = LIBRARY_PICTURE) -> List[str]:
    """Bands lowest first; ``unsorted`` on top, only when some module is in it."""
    names = [name for name, _ in picture.layers]
    if any(picture.layer(m) == UNSORTED for m in modules):
        names.append(UNSORTED)
    return names


# drawing ------------------------------------------------------------------------------

BOX_H, GAP = 22, 8
LABEL_W = 170  # left column: the layer's name and count
PER_ROW = 6
BAND_PAD = 10
COLUMN_W = 34  # one arrow column, room for its label
FONT = "font-family='DejaVu Sans Mono, Menlo, monospace'"


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


class Layout(NamedTuple):
    """Where a picture's bands and boxes lie."""
    bands: List[str]
    members: Dict[str, List[str]]  # band -> its modules
    groups: Dict[str, List[Group]]  # band -> its groups of boxes
    top: Dict[str, int]  # band -> y of its upper edge
    heights: Dict[str, int]
    total_h: int
    box_w: int


def _rows(groups: List[Group]) -> int:
    return max(1, sum(-(-len(labels) // PER_ROW) for _, labels in groups))


def _layout(picture: Picture, modules: List[str]) -> Layout:
    bands = layer_names(modules, picture)
    members = {b: sorted(m for m in modules if picture.layer(m) == b) for b in bands}
    groups = {b: picture.boxes(b, members[b]) for b in bands}
    longest = max((len(label) for b in bands for _, labels in groups[b] for label in labels),
                  default=0)
    heights = {b: 2 * BAND_PAD + 16 + _rows(groups[b]) * (BOX_H + GAP) for b in bands}
    total_h = 40 + sum(heights.values()) + 10  # the title's 40 pixels above the bands
    top: Dict[str, int] = {}
    y = total_h - 10
    for b in bands:  # lowest band at the bottom
        y -= heights[b]
        top[b] = y
    # DejaVu Sans Mono at 11 px advances 6.6 px a character: a box fits its longest label
    # (a label wider than its box ran into the next one)
    return Layout(bands, members, groups, top, heights, total_h,
                  max(picture.box_w, 67 * longest // 10 + 12))


def _draw_boxes(lay: Layout, band: str) -> List[str]:
    out = []
    row = 0
    for name, labels in lay.groups[band]:
        y0 = lay.top[band] + BAND_PAD + 16 + row * (BOX_H + GAP)
        if name:
            out.append(f"<text x='22' y='{y0 + 15}' fill='#333'>{escape(name)} "
                       f"({len(labels)})</text>")
        for k, label in enumerate(labels):
            bx = LABEL_W + (k % PER_ROW) * (lay.box_w + GAP)
            by = y0 + (k // PER_ROW) * (BOX_H + GAP)
            out.append(f"<rect x='{bx}' y='{by}' width='{lay.box_w}' height='{BOX_H}' "
                       f"rx='3' fill='white' stroke='#666'/>")
            out.append(f"<text x='{bx + 5}' y='{by + 15}'>{escape(label)}</text>")
        row += -(-len(labels) // PER_ROW)
    return out


def _draw_bands(picture: Picture, lay: Layout, width: int) -> List[str]:
    summary = dict(picture.layers)
    summary[UNSORTED] = "modules no mapping in docs/make_architecture.py knows yet"
    out = []
    for i, b in enumerate(lay.bands):
        fill = "#fff2cc" if b == UNSORTED else "#f4f4f4" if i % 2 == 0 else "#e8eef6"
        out.append(f"<rect x='0' y='{lay.top[b]}' width='{width}' height='{lay.heights[b]}' "
                   f"fill='{fill}' stroke='#bbb'/>")
        out.append(f"<text x='10' y='{lay.top[b] + 22}' font-size='13' font-weight='bold'>"
                   f"{escape(b)} ({len(lay.members[b])})</text>")
        out.append(f"<text x='{LABEL_W}' y='{lay.top[b] + BAND_PAD + 9}' fill='#555'>"
                   f"{escape(summary[b])}</text>")
        out += _draw_boxes(lay, b)
    return out


def _draw_arrow(c: Crossing, x: int, span: Tuple[int, int], up: bool) -> List[str]:
    y_top, y_bottom = span
    y0, y1 = (y_bottom, y_top) if up else (y_top, y_bottom)
    colour = "#c00" if up else "#333"
    my = (y0 + y1) // 2
    out = [f"<circle cx='{x}' cy='{y0}' r='2.5' fill='{colour}'/>",
           f"<line x1='{x}' y1='{y0}' x2='{x}' y2='{y1}' stroke='{colour}' "
           f"stroke-width='1.5' marker-end='url(#{'headup' if up else 'head'})'/>",
           f"<rect x='{x - 14}' y='{my - 10}' width='28' height='{24 if c.function_only else 13}' "
           f"fill='white' stroke='{colour}' stroke-width='0.5'/>",
           f"<text x='{x}' y='{my}' fill='{colour}' text-anchor='middle' "
           f"font-weight='bold'>{c.count}</text>"]
    if c.function_only:
        out.append(f"<text x='{x}' y='{my + 11}' fill='{colour}' text-anchor='middle' "
                   f"font-size='9'>{c.function_only}fn</text>")
    return out


def draw(picture: Picture, modules: List[str], edges: List[Edge]) -> str:
    """The SVG text of ``picture`` for these modules and imports."""
    lay = _layout(picture, modules)
    index = {b: i for i, b in enumerate(lay.bands)}
    middle = {b: lay.top[b] + lay.heights[b] // 2 for b in lay.bands}

    def span(c: Crossing) -> Tuple[int, int]:
        # the upper end sits below its band's middle and the lower end above its band's
        # middle, so an arrow ending in a band and one leaving it can share a column
        upper, lower = sorted((c.source, c.target), key=lambda b: -index[b])
        return middle[upper] + 8, middle[lower] - 8

    order = sorted(crossings(edges, picture.layer), key=lambda c: (span(c), c.source, c.target))
    cols = _columns([span(c) for c in order])
    arrows_x0 = LABEL_W + PER_ROW * (lay.box_w + GAP) + 24
    width = arrows_x0 + (max(cols) + 1 if cols else 1) * COLUMN_W + 10
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{lay.total_h}' "
           f"viewBox='0 0 {width} {lay.total_h}' {FONT} font-size='11'>",
           "<defs><marker id='head' markerWidth='8' markerHeight='8' refX='7' refY='4' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#333'/></marker>"
           "<marker id='headup' markerWidth='8' markerHeight='8' refX='7' refY='4' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#c00'/></marker></defs>",
           f"<rect width='{width}' height='{lay.total_h}' fill='white'/>",
           f"<text x='10' y='18' font-size='14' font-weight='bold'>{escape(picture.title)}, "
           f"lowest at the bottom ({len(modules)} modules, {len(edges)} imports)</text>",
           "<text x='10' y='34'>arrows: module pairs importing across two layers, from the dot "
           "(importer) to the head (imported); fn: of them, only inside functions; red: "
           "upward</text>"]
    out += _draw_bands(picture, lay, width)
    for c, col in zip(order, cols):
        x = arrows_x0 + col * COLUMN_W + 6
        out += _draw_arrow(c, x, span(c), index[c.target] > index[c.source])
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render(modules: List[str], edges: List[Edge]) -> str:
    """The SVG text of the library's picture."""
    return draw(LIBRARY_PICTURE, modules, edges)


def render_trainer(modules: List[str], edges: List[Edge]) -> str:
    """The SVG text of the trainer's picture (``modules``, ``edges``: the repository's)."""
    return draw(TRAINER_PICTURE, modules, edges)


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=REPO, help="repository root holding the package")
    parser.add_argument("--out", default=os.path.join(DOCS, "architecture.svg"),
                        help="the library's picture")
    parser.add_argument("--trainer-out", default=os.path.join(DOCS, "architecture-trainer.svg"),
                        help="the trainer's picture")
    args = parser.parse_args(argv)
    for out, picture, tops in ((args.out, LIBRARY_PICTURE, (PACKAGE,)),
                               (args.trainer_out, TRAINER_PICTURE, REPOSITORY)):
        modules, edges = import_edges(args.root, tops)
        _write(out, draw(picture, modules, edges))
        print(f"wrote {out}: {len(modules)} modules, {len(edges)} imports, "
              f"{len(crossings(edges, picture.layer))} layer crossings")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

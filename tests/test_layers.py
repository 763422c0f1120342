"""The import layering of ``src/attnlab`` (docs/architecture.md), read from the source with ``ast``: nothing is
imported, so the check is cheap and sees imports inside functions too.

A *unit* is a top-level module or package of attnlab (``config``, ``attention``, ``cost``, ...). Each may import
only the units ``MAY_IMPORT`` lists (and itself); inside ``attention`` the math sits below the modules
(``ATTENTION``). The core units use nothing but the standard library and torch, the cost model neither times,
prints nor plots, transformers is a baseline of the benchmarks only and typer belongs to the CLI. The table on
docs/architecture.md must say the same as ``MAY_IMPORT``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "attnlab"
DOC = ROOT / "docs" / "architecture.md"

BASE = {"config", "hf_config", "atomic", "console", "resources"}
MAY_IMPORT: dict[str, set[str]] = {
    "config": set(),
    "atomic": set(),
    "console": set(),
    "resources": set(),
    "families": {"config"},
    "hf_config": {"config", "families"},
    "cache": {"config"},
    "attention": {"config", "cache"},
    "model": {"config", "cache", "attention"},
    "cost": {"config", "hf_config"},
    "convert": {"config", "cache", "attention", "model"},
    "generate": {"config", "cache", "attention", "model", "cost"},
    "parallel": {"config", "cache", "attention", "model", "cost"},
    "hf": BASE | {"families", "cache", "attention", "model", "convert", "data"},
    "data": BASE - {"hf_config"},
    "train": BASE | {"cache", "attention", "model", "cost", "convert", "parallel", "hf", "data"},
    "bench": BASE
    | {"families", "cache", "attention", "model", "cost", "convert", "generate", "parallel", "hf", "data"},
    "jobs": {"atomic", "console"},
    "sweep": BASE
    | {
        "families",
        "cache",
        "attention",
        "model",
        "cost",
        "convert",
        "generate",
        "parallel",
        "hf",
        "data",
        "train",
        "bench",
        "jobs",
    },
    "cli": BASE
    | {
        "jobs",
        "sweep",
        "families",
        "cache",
        "attention",
        "model",
        "cost",
        "convert",
        "generate",
        "parallel",
        "hf",
        "data",
        "train",
        "bench",
    },
    "__main__": {"cli"},
    "__init__": {"config", "cache", "attention", "model"},
}
# attention/: norms, RoPE and the decode kernels below attend, attend below the modules, GQA's helpers below MLA.
ATTENTION: dict[str, set[str]] = {
    "norm": set(),
    "rope": set(),
    "decode": set(),
    "fused": set(),
    "backends": set(),
    "flex": set(),
    "triton_mla": set(),
    "flashinfer_decode": set(),
    "kernels": {"backends", "decode", "fused", "flex", "triton_mla", "flashinfer_decode"},
    "linear": {"fused"},
    "gqa": {"kernels", "linear", "rope", "norm"},
    "mla": {"gqa", "kernels", "linear", "rope", "norm"},
    "__init__": {"gqa", "mla", "kernels"},
}
CORE = (
    "config",
    "families",
    "hf_config",
    "cache",
    "attention",
    "model",
    "cost",
    "convert",
    "generate",
)  # stdlib and torch only
ONLY_IN = {"transformers": {"bench"}, "typer": {"cli"}}  # third-party packages kept to one unit
# The one exception, by file: scaled RoPE takes its frequencies from transformers' own ROPE_INIT_FUNCTIONS (issue
# 30: computed as transformers computes them, not re-derived), imported there lazily for scaled RoPE only.
# And the MLA decode kernel in Triton and FlashInfer's decode kernels (issue 34), optional dependencies imported only
# when their backends run.
ALLOWED = {
    ("attention/rope.py", "transformers"),
    ("attention/triton_mla.py", "triton"),
    ("attention/flashinfer_decode.py", "flashinfer"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``, relative ones resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                out.append((node.module, node.lineno))
                continue
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            if node.module:
                out.append((".".join([*base, node.module]), node.lineno))
            else:  # from . import io: each name is a module of the package
                out += [(".".join([*base, alias.name]), node.lineno) for alias in node.names]
    return out


def _unit(module: str) -> str:
    """attnlab.cost.flops -> cost; attnlab -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_unit_is_in_the_table():
    units = {_unit(_module_name(p)) for p in _sources()}
    assert units - set(MAY_IMPORT) == set(), "a new top-level module: give it a row in MAY_IMPORT and the doc"
    assert {p.stem for p in (SRC / "attention").glob("*.py")} == set(ATTENTION)


def test_units_import_only_the_layers_below_them():
    wrong = []
    for path in _sources():
        unit = _unit(_module_name(path))
        for module, line in _imports(path):
            if module == "attnlab" or module.startswith("attnlab."):
                target = _unit(module)
                if target != unit and target not in MAY_IMPORT[unit]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} ({unit}) imports {module} ({target})")
    assert wrong == []


def test_attention_math_sits_below_the_modules():
    wrong = []
    for path in (SRC / "attention").glob("*.py"):
        for module, line in _imports(path):
            if module.startswith("attnlab.attention."):
                target = module.split(".")[2]
                if target not in ATTENTION[path.stem]:
                    wrong.append(f"attention/{path.name}:{line} imports {module}")
    assert wrong == []


def test_third_party_packages_stay_where_they_belong():
    stdlib = set(sys.stdlib_module_names)
    wrong = []
    for path in _sources():
        unit = _unit(_module_name(path))
        for module, line in _imports(path):
            top = module.split(".")[0]
            if top == "attnlab":
                continue
            where = f"{path.relative_to(ROOT)}:{line} ({unit}) imports {module}"
            if (str(path.relative_to(SRC)), top) in ALLOWED:
                continue
            if unit in CORE and top not in stdlib | {"torch"}:
                wrong.append(where)
            if top in ONLY_IN and unit not in ONLY_IN[top]:
                wrong.append(where)
    assert wrong == []


def test_the_cost_model_neither_times_prints_nor_plots():
    wrong = []
    for path in (SRC / "cost").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for module, line in _imports(path):
            if module.split(".")[0] in {"time", "timeit", "rich", "matplotlib", "typer"}:
                wrong.append(f"cost/{path.name}:{line} imports {module}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"print", "open"}
            ):
                wrong.append(f"cost/{path.name}:{node.lineno} calls {node.func.id}")
    assert wrong == []


def test_the_architecture_page_states_the_same_layers():
    table = {}
    for row in re.findall(r"^\| `(\w+)` \|[^\n]*\| ([^|\n]+) \|$", DOC.read_text(), flags=re.MULTILINE):
        unit, allowed = row
        names = set(re.findall(r"`(\w+)`", allowed))
        table[unit] = (
            set(MAY_IMPORT) - {unit, "__main__", "__init__"} if allowed.strip() == "everything" else names
        )
    expected = {u: v for u, v in MAY_IMPORT.items() if u not in ("__main__", "__init__")}
    assert table == expected

"""GPU path inventory (issue 14 item 6): the lines the CPU test suite never runs because only a GPU takes them.

Measure the CPU suite first (``[tool.coverage.run]`` in pyproject.toml follows the rank workers and the
CLI subprocesses)::

    python -m coverage run -m pytest && python -m coverage combine
    python -m tests.benchmarks.gpu_only_lines [--data .coverage] [--json out.json]

A line counts as GPU-only when the CPU suite missed it *and* it sits where only a GPU goes: in the branch
of a condition that names CUDA, NCCL, nvml, pinned memory or a GPU (``if device.type == "cuda":``, the
``else`` of ``if not torch.cuda.is_available():``, the rest of a block after ``if ...: return`` guards of
that kind), in a function named after one (or after a GPU), or in a module that is GPU-only as a whole (nvml). Without a
GPU run to subtract, this is the CPU side of the definition; every place it lists is named in
docs/methods.md#gpu-only-code with the GPU test (tests/test_gpu.py) that runs it. Lines missed for any other reason
(error paths no test reaches) are counted apart, not hidden.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("zbench", "implementations")
#: What marks a GPU path in a condition (a GPU *count* such as ``--gpus`` is not one: it runs on a CPU too).
GPU = re.compile(r"cuda|nccl|nvml|pin_memory|is_pinned", re.IGNORECASE)
#: ... and in a function's name.
GPU_FUNCTION = re.compile(r"cuda|nccl|nvml|gpu", re.IGNORECASE)
#: Whole modules only a GPU machine executes past their imports.
GPU_MODULES = {"zbench/measure/nvml.py"}


@dataclass
class Place:
    """A function (or module level) with GPU-only lines the CPU suite missed."""

    file: str
    function: str
    guard: str
    lines: list[int]


def _negated(test: str) -> bool:
    """Whether the GPU branch of ``if <test>`` is its else (``not cuda``, ``!= "cuda"``, ``nvml is None``)."""
    t = test.strip()
    return t.startswith("not ") or "!=" in t or re.search(r"\bis None\b", t) is not None or " not in " in t


def _ends_block(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Return | ast.Raise | ast.Continue | ast.Break)


def _span(nodes: list[ast.stmt]) -> set[int]:
    lines: set[int] = set()
    for n in nodes:
        lines.update(range(n.lineno, (n.end_lineno or n.lineno) + 1))
    return lines


class _Guards(ast.NodeVisitor):
    """Every line in a GPU-only branch, with the guard that makes it so and the function it is in."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.guard: dict[int, str] = {}
        self.function: dict[int, str] = {}
        self._stack: list[str] = []

    def _mark(self, lines: set[int], guard: str) -> None:
        for line in lines:
            self.guard.setdefault(line, guard)

    def _block(self, body: list[ast.stmt]) -> None:
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.If):
                test = ast.get_source_segment(self.source, stmt.test) or ""
                if GPU.search(test):
                    negated = _negated(test)
                    self._mark(_span(stmt.orelse if negated else stmt.body), f"if {test}")
                    if negated and _ends_block(stmt.body) and not stmt.orelse:  # `if not cuda: return` guards the rest
                        self._mark(_span(body[i + 1 :]), f"after `if {test}: return`")
            self.visit(stmt)

    def generic_visit(self, node: ast.AST) -> None:
        for _, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self._block(value)
            elif isinstance(value, list):
                for child in value:
                    if isinstance(child, ast.AST):
                        self.visit(child)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._stack.append(node.name)
        name = ".".join(self._stack)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            self.function[line] = name
        if GPU_FUNCTION.search(node.name):
            self._mark(_span(node.body), f"def {node.name}")
        self._block(node.body)
        self._stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._stack.append(node.name)
        self._block(node.body)
        self._stack.pop()

    def visit_IfExp(self, node: ast.IfExp) -> None:
        test = ast.get_source_segment(self.source, node.test) or ""
        if GPU.search(test):
            branch = node.orelse if _negated(test) else node.body
            self._mark(set(range(branch.lineno, (branch.end_lineno or branch.lineno) + 1)), f"{test} ? ...")
        self.generic_visit(node)


def gpu_branches(source: str) -> _Guards:
    """Classify every line of ``source``: its GPU guard (if any) and the function it is in."""
    guards = _Guards(source)
    guards.visit(ast.parse(source))
    return guards


def inventory(data_file: Path) -> tuple[list[Place], dict[str, int]]:
    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    places: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    totals = {"statements": 0, "missed": 0, "gpu_only": 0, "missed_other": 0}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            _, statements, _, missing, _ = cov.analysis2(str(path))
            source = path.read_text()
            guards = gpu_branches(source)
            totals["statements"] += len(statements)
            totals["missed"] += len(missing)
            for line in missing:
                guard = "module" if rel in GPU_MODULES else guards.guard.get(line)
                if guard is None:
                    totals["missed_other"] += 1
                    continue
                totals["gpu_only"] += 1
                places[(rel, guards.function.get(line, "<module>"), guard)].append(line)
    return [Place(f, fn, g, lines) for (f, fn, g), lines in sorted(places.items())], totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / ".coverage", help="combined coverage data file")
    parser.add_argument("--json", type=Path, help="write the inventory here too")
    args = parser.parse_args()
    places, totals = inventory(args.data)
    by_file: dict[str, int] = defaultdict(int)
    for p in places:
        by_file[p.file] += len(p.lines)
    print("| file | function | guard | GPU-only lines |")
    print("|---|---|---|---|")
    for p in places:
        print(f"| {p.file} | {p.function} | `{p.guard}` | {len(p.lines)} ({p.lines[0]}-{p.lines[-1]}) |")
    print()
    print(
        f"{totals['gpu_only']} GPU-only lines in {len(by_file)} files, {len(places)} places; "
        f"{totals['missed_other']} other lines the CPU suite misses; {totals['statements']} statements in all"
    )
    if args.json:
        args.json.write_text(json.dumps({"totals": totals, "places": [asdict(p) for p in places]}, indent=1))


if __name__ == "__main__":
    main()

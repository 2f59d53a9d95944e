"""The wrong-implementation matrix at any model size: how far past its bound each planted bug lands.

``tests/test_wrong_implementations.py`` runs the matrix on ``tiny`` as a test (every bug NOT
EQUIVALENT, every correct implementation equivalent). A bigger model dilutes a bug confined to a
few tensors, so the margins are also wanted at ``small`` and ``medium``, which are too slow for a
test run on CPU. This runs the same suite (the same bugs, settings and controls) with the model,
world sizes and precisions given, through the real CLI, and prints two Markdown tables:

- per bug, the check furthest past its bound and by how much (figure / bound), or *passes*;
- per check, the worst fraction of its bound that any correct implementation reached (the noise floor).

``python -m tests.benchmarks.wrong_matrix_margins --model medium --worlds 2 --out medium.json``
from the repository root (about 45 minutes for ``medium`` at world 2 on 2 cores). ``-k`` selects as ``zbench
run`` does: the test's own selection (every case at world 2, the ZeRO engine's at world 3) is
``-k '*-w2-*' -k '*wrong_ZERO-*'``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.test_wrong_implementations import BUGS, CORRECT, label, suite_yaml

REPO = Path(__file__).resolve().parents[2]
CORRECT_BUILT_IN = ("ddp-twin", "fsdp", "torch_zero", "zero1", "zero2", "zero3")


def suite_for(model: str, worlds: list[int], precisions: list[str], with_built_ins: bool) -> str:
    text = suite_yaml()
    text = text.replace("models: tiny", f"models: {model}").replace("world_sizes: [2, 3]", f"world_sizes: {worlds}")
    text = text.replace("precisions: [fp32, bf16]", f"precisions: {precisions}")
    if with_built_ins:
        text = text.replace("implementations: [ddp, ", "implementations: [ddp, fsdp, torch_zero, zero1, zero2, zero3, ")
    return text + "paired_rounds: 0\ntimeout_s: 3600\n"


def check_label(check: dict) -> str:
    """``fp32 probe parameters`` for a check of a bf16 case's fp32 probe, else the check's name."""
    return f"fp32 probe {check['name']}" if check.get("probe") else check["name"]


def cell(case: dict) -> tuple[str, float | None]:
    """The check furthest past its bound (``name margin``); ``ranks`` when only the rank checksums failed; else
    the largest fraction of a bound reached."""
    if case["status"] != "ok":
        return f"{case['status']}", None
    checks = [c for c in case["equivalence"]["checks"] if c.get("figure") is not None and c.get("bound")]
    ranks_failed = any(c["name"] == "ranks" and c["passed"] is False for c in case["equivalence"]["checks"])
    worst = max(checks, key=lambda c: c["figure"] / c["bound"], default=None)
    margin = worst["figure"] / worst["bound"] if worst else None
    if worst and margin is not None and margin > 1:
        return f"{check_label(worst)} {margin:.2g}".replace("e+0", "e"), margin
    if ranks_failed:
        return "ranks", None
    return (f"*passes* ({margin:.2f})" if margin is not None else "no checks"), margin


def tables(cases: dict[tuple[str, str, int], dict], columns: list[tuple[str, int]], model: str) -> str:
    head = [f"{model} {p} w{w}" for p, w in columns]
    out = ["| bug | " + " | ".join(head) + " |", "|---|" + "---|" * len(columns)]
    for bug in dict.fromkeys(b for bugs in BUGS.values() for b in bugs):  # every world's, in order
        row = [cell(cases[(bug, p, w)])[0] if (bug, p, w) in cases else "" for p, w in columns]
        out.append(f"| {bug} | " + " | ".join(row) + " |")
    out += ["", "| check (correct implementations, worst fraction of the bound) | " + " | ".join(head) + " |"]
    out.append("|---|" + "---|" * len(columns))
    correct = [*dict.fromkeys(name for names in CORRECT.values() for name in names), *CORRECT_BUILT_IN]
    labels = (
        "loss",
        "grad_norm",
        "parameters",
        "model_state",
        *(f"fp32 probe {c}" for c in ("loss", "grad_norm", "parameters")),
    )
    for check in labels:
        row = []
        for p, w in columns:
            fractions = [
                c["figure"] / c["bound"]
                for name in correct
                if (name, p, w) in cases and cases[(name, p, w)]["status"] == "ok"
                for c in cases[(name, p, w)]["equivalence"]["checks"]
                if check_label(c) == check and c.get("figure") is not None and c.get("bound")
            ]
            row.append(f"{max(fractions):.2f}" if fractions else "")
        out.append(f"| {check} | " + " | ".join(row) + " |")
    verdicts = [
        f"{name} {p} w{w}: NOT EQUIVALENT ({cases[(name, p, w)]['equivalence']['reason']})"
        for name in correct
        for p, w in columns
        if (name, p, w) in cases
        and cases[(name, p, w)]["status"] == "ok"
        and not cases[(name, p, w)]["equivalence"]["equivalent"]
    ]
    return "\n".join(out + (["", *verdicts] if verdicts else []))


def label_with_built_ins(case: dict) -> str:
    implementation = case["config"]["implementation"]
    return implementation if implementation in CORRECT_BUILT_IN else label(case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="model preset (tiny, small, medium, ...)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2], help="world sizes")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], help="precisions")
    parser.add_argument("--built-ins", action="store_true", help="also run fsdp, torch_zero and zero1-3 as controls")
    parser.add_argument(
        "-k",
        dest="select",
        action="append",
        default=[],
        help="zbench run's -k, repeatable (e.g. the test's selection: -k '*-w2-*' -k '*wrong_ZERO-*')",
    )
    parser.add_argument("--out", type=Path, default=None, help="write every case's checks as JSON")
    parser.add_argument("--keep", type=Path, default=None, help="run here and keep it (default: a temporary directory)")
    parser.add_argument("--tables-only", action="store_true", help="print the tables of the run already in --keep")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zbench-margins-") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        suite = where / "margins.yaml"
        suite.write_text(suite_for(args.model, args.worlds, args.precisions, args.built_ins))
        results = where / "results"
        if not args.tables_only:
            command = ["-m", "zbench", "run", str(suite), "--results", str(results), "--report", str(where / "r")]
            command += [arg for pattern in args.select for arg in ("-k", pattern)]
            subprocess.run([sys.executable, *command], cwd=REPO, check=False)
        cases = {}
        for path in results.glob("*/cases/*.json"):
            case = json.loads(path.read_text())
            config = case["config"]
            cases[(label_with_built_ins(case), config["precision"], config["world_size"])] = case
    columns = [(p, w) for p in args.precisions for w in args.worlds]
    print(tables(cases, columns, args.model))
    if args.out:
        slim = {
            f"{name} {p} w{w}": {"status": c["status"], "equivalence": c.get("equivalence")}
            for (name, p, w), c in cases.items()
        }
        args.out.write_text(json.dumps(slim, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

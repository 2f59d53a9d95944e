"""The ``zbench`` command line: one module per command (or small family), each parsing, calling the harness and
printing; exit codes 0 ok, 1 a check failed, 2 bad input.

``zbench = "zbench.cli:main"`` is the installed script. The commands are registered here, in the order
``zbench --help`` lists them.
"""

from zbench.cli import calibrate, compare, env, gate, info, plan, report, results, run, tune
from zbench.cli.app import app, main

COMMANDS = (
    ("run", run.run),
    ("compare", compare.compare),
    ("check", gate.check),
    ("ab", gate.ab),
    ("plan", plan.plan),
    ("tune", tune.tune),
    ("calibrate", calibrate.calibrate_cmd),
    ("report", report.report_cmd),
    ("list", info.list_cmd),
    ("gc", results.gc_cmd),
    ("export", results.export_cmd),
    ("env", env.env_cmd),
)
for name, command in COMMANDS:
    app.command(name)(command)

__all__ = ["COMMANDS", "app", "main"]

"""``zbench env``: what zbench sees: versions, distributed backends, GPUs, driver, nvml."""

from __future__ import annotations

import json

from rich.text import Text

from zbench.cli.options import JsonOpt, stdout


def env_cmd(as_json: JsonOpt = False) -> None:
    """What zbench sees: versions, distributed backends, GPUs, driver, nvml."""
    from zbench.run import environment

    info = environment.collect()
    if as_json:
        print(json.dumps(info, indent=1))
        return
    out = stdout()
    for key, value in info.items():
        out.print(Text(f"{key}: ", style="bold") + Text(str(value)))

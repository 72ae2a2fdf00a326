"""The README's console blocks as commands: what the README and kind suites replay as typed."""
from __future__ import annotations

import re


def console_commands(text: str, heading: str) -> list[str]:
    """The commands of the first console block under `## <heading>`: each `$ ` line, with the lines
    it continues onto (a trailing backslash) joined as the shell reads them."""
    section = re.search(rf"^## {re.escape(heading)}\b.*?(?=^## |\Z)", text, re.S | re.M)
    if not section:
        raise ValueError(f"README.md has no '## {heading}' section")
    block = re.search(r"^```console\n(.*?)^```", section.group(0), re.S | re.M)
    if not block:
        raise ValueError(f"the README's '{heading}' section has no ```console block")
    commands: list[str] = []
    lines = iter(block.group(1).splitlines())
    for line in lines:
        if not line.startswith("$ "):
            continue  # output shown in the README
        command = [line[2:]]
        while command[-1].endswith("\\"):
            command.append(next(lines, ""))
        commands.append("\n".join(command))
    return commands

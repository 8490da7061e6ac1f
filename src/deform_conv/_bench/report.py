"""How results are written: the numbers' formats, a results file (title, command, environment line, table) and
the command it names."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence


def _ms(seconds: Optional[float]) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.2f}"


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _document(title: str, command: str, env: str, header: str, lines: Sequence[str], notes: Sequence[str] = ()) -> str:
    """A results file: title, command, environment line (and notes), then the table."""
    return "\n".join([f"# {title}", "", f"Command: `{command}`", "", env, "", *[f"{n}\n" for n in notes], header,
                      *lines, ""])


def command_line(args: argparse.Namespace) -> str:
    """The command a results file names: the flags that choose what was run."""
    parts = ["deform-conv bench"] + [f"--{flag}" for flag in ("smoke", "extra", "small") if getattr(args, flag)]
    if args.threads is not None:
        parts.append("--threads " + ",".join(map(str, args.threads)))
    if args.dtype != "float32":
        parts.append(f"--dtype {args.dtype}")
    return " ".join(parts)


def _write(out: Optional[Path], name: str, text: str) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
        print(f"wrote {out / name}")

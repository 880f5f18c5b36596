"""Help in sections: a click Command whose options are listed under headings.

click lists every option in one block; `SectionedCommand` prints them grouped by the
`section` each option was declared with (`section_option`), in the order the sections first
appear; options declared without one (--quiet, --json, --help) come last, under "Output".
"""

from __future__ import annotations

from typing import Any

import click


class SectionedOption(click.Option):
    """A click Option that belongs to a help section."""

    def __init__(self, *args: Any, section: str = "Options", **kw: Any):
        super().__init__(*args, **kw)
        self.section = section


def section_option(section: str, *param_decls: str, **kw: Any):
    """click.option(...) under the heading `section`."""
    return click.option(*param_decls, cls=SectionedOption, section=section, **kw)


class SectionedCommand(click.Command):
    """Formats its options under their sections' headings."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        rest: list[tuple[str, str]] = []
        for p in self.get_params(ctx):
            rec = p.get_help_record(ctx) if isinstance(p, click.Option) else None
            if rec is None:
                continue
            (sections.setdefault(p.section, []) if hasattr(p, "section") else rest).append(rec)
        for name, rows in [*sections.items(), ("Output", rest)]:
            with formatter.section(name):
                formatter.write_dl(rows)

"""The ``--help`` formatter of kda_compile's command lines (``python -m kda_compile.bench``, ``python -m
kda_compile.coverage``). Imports nothing heavy: the coverage worker processes start from it."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with descriptions and epilogs as written and each option's default shown (where it has one: not
    None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"

"""The ``vllm serve`` parser's ``--kv-cache-dtype`` option, widened by one value.

argparse has no public way to change an option another package added, so the option is found
among the parser's actions (seam ``argparse.actions``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qaic_vllm.compat.seams import SEAMS

_WIDENED = "qaic_widened"


def accept_option_value(parser: Any, option: str, value: str, convert: Callable[[Any], Any]) -> None:
    """Let ``option`` take ``value`` besides its choices; its type becomes ``convert(previous type)``.

    Done once per parser; a parser without the option is left as it is.
    """
    SEAMS["argparse.actions"].probe(parser)
    for action in parser._actions:
        if option in action.option_strings and not getattr(action, _WIDENED, False):  # set only here
            if action.choices is not None and value not in action.choices:
                action.choices = [*action.choices, value]
            action.type = convert(action.type)
            setattr(action, _WIDENED, True)

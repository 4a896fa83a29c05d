"""Pointers from error messages to the sections of docs/troubleshooting.md that explain more.

An error message says what happened and what to do in a line or two; the
longer story (likely causes, commands to check them) lives once, in the
troubleshooting guide, and the message ends with :func:`see`. A test checks
that every anchor used in the code exists in the guide.
"""

from __future__ import annotations

__all__ = ["TROUBLESHOOTING_URL", "see"]

TROUBLESHOOTING_URL = "https://github.com/ddpkit/ddpkit/blob/main/docs/troubleshooting.md"


def see(anchor: str) -> str:
    """``"See <troubleshooting guide>#<anchor>"``: the last sentence of an error message."""
    return f"See {TROUBLESHOOTING_URL}#{anchor}"

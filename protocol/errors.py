"""The protocol's one error type. Decoding untrusted bytes raises only this (with a code)."""

from __future__ import annotations


class ProtocolError(Exception):
    """A peer sent something the protocol forbids, or a local call broke a protocol rule.

    ``code`` is a stable snake_case name (the mesh node maps it onto its own error hierarchy);
    ``fatal`` says whether the link must be torn down (every receive-side violation is fatal:
    after one, nothing else the peer sends can be trusted to be framed correctly).
    """

    def __init__(self, code: str, message: str, *, fatal: bool = True) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.fatal = fatal

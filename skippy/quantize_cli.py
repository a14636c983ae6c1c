"""``skippy-quantize``: the second console script (``python -m skippy.quantize_cli``).

Same conventions as ``skippy-model-package`` (one parser/renderer in ``skippy.cli``): exit
codes 0/1/2, ``error [code]: ...`` without a traceback, ``--json`` one document, progress on
a terminal. Its one command, ``quantize-layer-package``, lives in ``skippy.commands.quantize``.
"""

from __future__ import annotations

from collections.abc import Sequence

from skippy import cli

PROG = "skippy-quantize"
DESCRIPTION = "Quantize a high-precision model straight into a layer package."


def main(argv: Sequence[str] | None = None) -> int:
    from skippy.commands import quantize

    return cli.main(argv, prog=PROG, description=DESCRIPTION, modules=(quantize,))


if __name__ == "__main__":
    raise SystemExit(main())

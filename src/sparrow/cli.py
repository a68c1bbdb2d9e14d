"""The ``sparrow`` command: ``sparrow calibrate ...`` (RTPurbo head profile + indexer from a checkpoint)."""

from __future__ import annotations

import sys

USAGE = """usage: sparrow <command> [args]

commands:
  calibrate   find retrieval heads and fit the RTPurbo indexer for a checkpoint (sparrow calibrate -h)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "calibrate":
        from sparrow.calibrate import main as calibrate

        return int(calibrate(rest) or 0)
    print(f"sparrow: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

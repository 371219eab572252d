"""``python -m jaxflash.report <workdir> [<workdir> ...] [--out DIR] [--step N]``."""

from __future__ import annotations

import argparse
import sys

from jaxflash.report.build import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxflash.report",
        description="PNG plots of run workdirs (compared on shared figures) or a results JSON.",
    )
    parser.add_argument("sources", nargs="+", help="run workdirs, or one benchmark results .json")
    parser.add_argument("--out", default=None, help="output directory (default: <first>/report)")
    parser.add_argument("--step", type=int, default=None, help="timeline step (default: last)")
    args = parser.parse_args(argv)
    try:
        sidecar = write_report(args.sources, args.out, step=args.step)
    except (FileNotFoundError, ValueError) as err:
        print(f"jaxflash.report: {err}", file=sys.stderr)
        return 2
    for name, fig in sidecar["figures"].items():
        print(f"{name}: {fig['path']} ({', '.join(fig['panels'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

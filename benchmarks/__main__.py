"""Run every benchmark and print one report."""

from __future__ import annotations

from . import builder_scaling


def main() -> None:
    print("## Builder time\n")
    print(builder_scaling.report(builder_scaling.measure()))


if __name__ == "__main__":
    main()

"""Print the catalogue's cases by package and outcome as Markdown (the body of docs/reliability.md).

Usage: python tests/reliability/catalogue_table.py  (paste its output below the intro of docs/reliability.md)
"""

import collections
import contextlib
import io
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
OUTCOMES = ("clear error", "right result", "recovered")
NEVER = ("silent wrong result", "crash", "hang")


class _Collector:
    def __init__(self):
        self.cases = []

    def pytest_collection_finish(self, session):
        for item in session.items:
            package = item.path.parent.name
            self.cases.append((package, item.get_closest_marker("outcome").args[0], item.name))


def main():
    collector = _Collector()
    with contextlib.redirect_stdout(io.StringIO()) as listing:
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(HERE)], plugins=[collector])
    if code:
        sys.exit(listing.getvalue()[-3000:])
    counts = collections.Counter((package, outcome) for package, outcome, _ in collector.cases)
    packages = sorted({package for package, _, _ in collector.cases})
    lines = ["| package | " + " | ".join(OUTCOMES + NEVER) + " | cases |", "|---" * (len(OUTCOMES + NEVER) + 2) + "|"]
    for package in [*packages, "all"]:
        row = [sum(n for (p, o), n in counts.items() if o == outcome and package in (p, "all")) for outcome in OUTCOMES]
        lines.append(f"| {package} | " + " | ".join(map(str, row + [0] * len(NEVER) + [sum(row)])) + " |")
    for package in packages:
        lines += ["", f"### {package}", ""]
        for outcome in OUTCOMES:
            names = sorted(name for p, o, name in collector.cases if p == package and o == outcome)
            if names:
                lines.append(f"- **{outcome}** ({len(names)}): " + ", ".join(f"`{name}`" for name in names))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""A self-contained HTML report of a popsim profile: one file that opens from disk, with no network access.

Views: a summary (cycles by compute / exchange / sync / host, simulated time, throughput, FLOPs against
the target's peak), a zoomable BSP timeline with the tiles and IPUs each step kept busy, the last call's
timeline (each replica's IPUs' compute tiles and I/O tiles as lanes: runs, pipeline stages, phases, host
transfers on the I/O tiles), a heat map of tile memory (click a tile for the tensors live at its peak by
category, against its budget, and every tensor placed on it) with the I/O tiles' tensors beside it, the
operations grouped by module and source line (sortable by cycles or bytes), memory liveness over the program,
with replication each replica's runs and the all-reduce between them, and a comparison of two profiles.

The charts are drawn by plotly.js, bundled into the file from the ``plotly`` Python package (MIT
licence): a well-kept library whose one minified script ships inside the wheel, so the report needs no
network and no second file. The script is stored deflated (base64, 4.8 MB -> 2 MB) and the page inflates it
with the browser's DecompressionStream. Command line::

    python -m popsim.report profile.json -o report.html [--compare before.json] [--samples-per-run N]
"""

import argparse
import base64
import functools
import importlib.util
import json
import os
import pathlib
import zlib

from popsim.errors import Error
from popsim.profile import Profile, operations

_TEMPLATE = pathlib.Path(__file__).with_name("report_template.html")
_PLOTLY_JS = ("package_data", "plotly.min.js")


def plotly_js():
    """The text of plotly.js as the installed ``plotly`` package ships it."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise Error("the HTML report bundles plotly.js from the 'plotly' package; install it: pip install plotly")
    path = pathlib.Path(next(iter(spec.submodule_search_locations)), *_PLOTLY_JS)
    if not path.is_file():
        raise Error(f"the installed plotly package has no {'/'.join(_PLOTLY_JS)}; reinstall it: pip install plotly")
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _deflated(text):
    """``text`` zlib-deflated and base64-encoded, as the report's page inflates it (cached: deflating plotly.js
    takes a good part of a second)."""
    return base64.b64encode(zlib.compress(text.encode("utf-8"), zlib.Z_BEST_COMPRESSION)).decode("ascii")


def _as_profile(profile):
    """A Profile-like view of ``profile``: a Profile, its JSON dict, JSON text or a path to a JSON file."""
    if isinstance(profile, Profile):
        return json.loads(profile.to_json())
    if isinstance(profile, dict):
        return profile
    text = str(profile)
    if not text.lstrip().startswith("{"):
        try:
            text = pathlib.Path(text).read_text(encoding="utf-8")
        except OSError as exc:
            raise Error(f"cannot read the profile {profile!s}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Error(f"not a popsim profile (invalid JSON: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("programs"), dict):
        raise Error("not a popsim profile: the JSON has no 'programs' object (write one with Profile.to_json)")
    return data


def _operations(data):
    """Profile.operations of every program of a profile dict (the one place rows are computed)."""
    return {name: operations(p) for name, p in data["programs"].items()}


def _section(data, title):
    return {"title": title, "profile": data, "operations": _operations(data)}


def render(profile, compare=None, title="popsim profile", compare_title="before", samples_per_run=None):
    """The report as HTML text. ``profile`` (and ``compare``, the profile to compare against) may be a
    Profile, its JSON dict, JSON text or a JSON file's path; ``samples_per_run`` (the samples one run of a
    program processes) adds samples per second to the summary."""
    if samples_per_run is not None and (not isinstance(samples_per_run, int) or samples_per_run < 1):
        raise Error(f"samples_per_run must be a positive integer, got {samples_per_run!r}")
    payload = {
        **_section(_as_profile(profile), title),
        "compare": None if compare is None else _section(_as_profile(compare), compare_title),
        "samples_per_run": samples_per_run,
    }
    # JSON inside a <script> element: "<" escaped so no "</script>" in a module name can end it.
    data = json.dumps(payload).replace("<", "\\u003c")
    html = _TEMPLATE.read_text(encoding="utf-8")
    return html.replace("/*PLOTLY_DEFLATED*/", _deflated(plotly_js()), 1).replace("/*REPORT_DATA*/", data, 1)


def save_html(profile, path, **options):
    """Write the report of ``profile`` to ``path`` (see ``render`` for ``options``); returns the path."""
    path = pathlib.Path(path)
    if path.parent and not path.parent.is_dir():
        raise Error(f"cannot write the report to {path}: folder {path.parent} does not exist")
    path.write_text(render(profile, **options), encoding="utf-8")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m popsim.report", description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile JSON file (Profile.to_json)")
    parser.add_argument("-o", "--output", default="report.html", help="the HTML file to write")
    parser.add_argument("--compare", help="a second profile JSON to compare against (before a change)")
    parser.add_argument("--samples-per-run", type=int, help="samples one run processes, for samples per second")
    args = parser.parse_args(argv)
    try:
        path = save_html(
            args.profile,
            args.output,
            compare=args.compare,
            title=os.path.basename(args.profile),
            compare_title=os.path.basename(args.compare) if args.compare else "before",
            samples_per_run=args.samples_per_run,
        )
    except Error as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"report written to {path}")


if __name__ == "__main__":
    main()

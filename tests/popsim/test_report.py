"""The HTML report: one self-contained file with the profile's data and plotly.js, from Python or the
command line, with a comparison of two profiles; refusals name the cause."""

import base64
import json
import re
import subprocess
import sys
import zlib

import pytest

import popir
import popsim
from popir import ops
from popsim import report


def _profile(width=16):
    g = popir.Graph("main")
    x = g.add_input("x", (4, width), "float32")
    w = g.add_input("fc.weight", (width, 8), "float32", kind="parameter")
    with g.annotate(module="fc", aten="aten.mm.default", source="net.py:3: y = x @ w", role="forward"):
        g.output("y", ops.relu(x @ w))
    return popsim.compile(g, popsim.Target.small()).profile


def _embedded(html):
    text = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(text)


def test_report_is_one_file_with_the_profile_plotly_and_no_outside_resources(tmp_path):
    profile = _profile()
    path = profile.save_html(tmp_path / "report.html", samples_per_run=4)
    html = path.read_text()
    data = _embedded(html)
    assert data["profile"]["programs"] == json.loads(profile.to_json())["programs"]
    assert data["operations"]["main"] == profile.operations("main")
    assert data["samples_per_run"] == 4 and data["compare"] is None
    # plotly.js travels deflated and base64-encoded, at well under half its size.
    packed = re.search(r'<script type="application/base64" id="plotly-deflated">(.*?)</script>', html, re.S).group(1)
    assert zlib.decompress(base64.b64decode(packed)).decode() == report.plotly_js()
    assert len(html) < len(report.plotly_js()) / 2
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)
    for view in ("summary", "timeline-chart", "heatmap-chart", "tile-detail", "operations-table", "liveness-chart"):
        assert f'id="{view}"' in html


def test_names_from_the_model_cannot_end_the_data_script():
    profile = _profile()
    profile.programs["main"]["steps"][0]["origin"]["module"] = "</script><script>alert(1)</script>"
    data = _embedded(report.render(profile))
    assert data["profile"]["programs"]["main"]["steps"][0]["origin"]["module"].startswith("</script>")


def test_command_line_writes_a_comparison_report(tmp_path):
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    _profile(16).to_json(before)
    _profile(32).to_json(after)
    out = tmp_path / "cmp.html"
    run = subprocess.run(
        [sys.executable, "-m", "popsim.report", str(after), "-o", str(out), "--compare", str(before)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(out) in run.stdout
    data = _embedded(out.read_text())
    assert data["title"] == "after.json" and data["compare"]["title"] == "before.json"
    assert data["compare"]["profile"]["programs"]["main"] == json.loads(before.read_text())["programs"]["main"]


def test_bad_inputs_are_refused_with_the_cause(tmp_path, monkeypatch):
    with pytest.raises(popsim.Error, match="cannot read the profile"):
        report.render(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(popsim.Error, match="no 'programs'"):
        report.render(tmp_path / "bad.json")
    with pytest.raises(popsim.Error, match="samples_per_run must be a positive integer"):
        report.render(_profile(), samples_per_run=0)
    with pytest.raises(popsim.Error, match="folder .* does not exist"):
        report.save_html(_profile(), tmp_path / "nowhere" / "r.html")
    run = subprocess.run(
        [sys.executable, "-m", "popsim.report", str(tmp_path / "bad.json")], capture_output=True, text=True
    )
    assert run.returncode == 2 and "no 'programs'" in run.stderr
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(popsim.Error, match="pip install plotly"):
        report.render(_profile())

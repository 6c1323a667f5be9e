"""POPLAR_ENGINE_OPTIONS' autoReport switches write the profile and its HTML report when compiling;
PoplarExecutor.profile.save_html writes the report on demand; engine options not modelled are refused."""

import json

import pytest
import torch

import poptorch
from poptorch import _auto_report


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def _inference(options=None):
    model = poptorch.inferenceModel(_Net(), options or poptorch.Options())
    model(torch.randn(2, 4))
    return model


def _data(html):
    start = html.index('id="report-data">') + len('id="report-data">')
    return json.loads(html[start : html.index("</script>", start)])


def test_auto_report_all_writes_profile_and_report_in_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(_auto_report.ENV, json.dumps({"autoReport.all": "true", "autoReport.directory": str(tmp_path)}))
    model = _inference(poptorch.Options().modelName("tiny"))
    folder = tmp_path / "tiny"
    profile = json.loads((folder / "profile.json").read_text())
    assert profile["programs"] == json.loads(model.profile.to_json())["programs"]
    # Written again after the first call, with what running showed: the call's timeline.
    assert profile["programs"]["inference"]["run_timeline"]["makespan"] > 0
    data = _data((folder / "report.html").read_text())
    assert data["profile"]["programs"] == profile["programs"]
    modules = {s["origin"].get("module") for s in data["profile"]["programs"]["inference"]["steps"] if s.get("origin")}
    assert "fc" in modules


def test_auto_report_defaults_to_the_working_directory_and_off_switches_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(_auto_report.ENV, '{"autoReport.all": "false"}')
    _inference()
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(_auto_report.ENV, '{"autoReport.outputExecutionProfile": true}')
    _inference()
    assert (tmp_path / "inference" / "report.html").is_file()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{autoReport.all", "not valid JSON"),
        ('["autoReport.all"]', "must be a JSON object"),
        ('{"autoReport.all": "yes"}', 'must be "true" or "false"'),
        ('{"autoReport.all": "true", "debug.instrument": "true"}', "does not model the engine option"),
    ],
)
def test_bad_engine_options_are_refused_before_compiling(monkeypatch, value, match):
    monkeypatch.setenv(_auto_report.ENV, value)
    model = poptorch.inferenceModel(_Net(), poptorch.Options())
    with pytest.raises(poptorch.Error, match=match):
        model(torch.randn(2, 4))
    assert not model.isCompiled()


def test_executor_profile_saves_the_html_report(tmp_path):
    model = _inference()
    path = model.profile.save_html(tmp_path / "r.html")
    assert _data(path.read_text())["operations"]["inference"] == model.profile.operations("inference")

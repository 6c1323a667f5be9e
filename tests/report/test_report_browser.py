"""The tutorial CNN's HTML profile report in headless Chromium (Debian's, driven by Selenium): the summary,
timeline and tile heat map are drawn without console errors, clicking a tile lists its tensors, the
operation table sorts, and the comparison view shows. Screenshots and the HTML reports go to the folder
``REPORT_ARTIFACTS`` names (the nox session sets build/report-artifacts), else pytest's tmp_path."""

import base64
import json
import os
import pathlib
import sys

import pytest
import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import popir
import popsim
import poptorch
from popsim.provenance import CATEGORIES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from train_digits import ClassificationModel, ModelWithLoss  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900")
BATCH = 16
WAIT_SECONDS = 60


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    folder = os.environ.get("REPORT_ARTIFACTS")
    path = pathlib.Path(folder) if folder else tmp_path_factory.mktemp("report")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def profile():
    torch.manual_seed(0)
    model = ModelWithLoss(ClassificationModel(), torch.nn.NLLLoss())
    options = poptorch.Options().randomSeed(0)
    training = poptorch.trainingModel(model, options, poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    training.compile(torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,)))
    return training.profile


@pytest.fixture(scope="module")
def browser(monkeypatch_module):
    # Never let Selenium fetch a driver or a browser: both come from Debian's packages.
    monkeypatch_module.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _open(browser, path):
    browser.get(path.resolve().as_uri())
    WebDriverWait(browser, WAIT_SECONDS).until(
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, "#heatmap-chart .heatmaplayer")
            and d.find_elements(By.CSS_SELECTOR, "#liveness-chart .scatterlayer")
        )
    )


def _screenshot(browser, section, path):
    """A screenshot of the whole ``section`` element, also the part below the window (Chromium's DevTools
    capture; an element screenshot shows only what fits in the window)."""
    box = browser.execute_script(
        """const r = document.getElementById(arguments[0]).getBoundingClientRect();
        return {x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height, scale: 1};""",
        section,
    )
    shot = browser.execute_cdp_cmd("Page.captureScreenshot", {"clip": box, "captureBeyondViewport": True})
    path.write_bytes(base64.b64decode(shot["data"]))


def _errors(browser):
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _click_tile(browser, tile):
    """Click the heat map cell of ``tile`` where a user would: at its pixel on the plot."""
    dx, dy = browser.execute_script(
        """const gd = document.getElementById("heatmap-chart"), tile = arguments[0];
        const cols = gd.data[0].z[0].length, xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        return [xa.l2p(tile % cols) - xa._length / 2, ya.l2p(Math.floor(tile / cols)) - ya._length / 2];""",
        tile,
    )
    plot = browser.find_element(By.CSS_SELECTOR, "#heatmap-chart .nsewdrag")
    ActionChains(browser).move_to_element_with_offset(plot, round(dx), round(dy)).click().perform()
    WebDriverWait(browser, WAIT_SECONDS).until(
        lambda d: d.find_element(By.ID, "tile-detail").get_attribute("data-tile") == str(tile)
    )


def _live_at_peak(program, tile):
    """{name: bytes} of the tensors live on ``tile`` where their bytes peak (the earliest such point), from the
    profile's live ranges."""
    count = len(program["liveness"]["points"])
    on_tile = []
    for t in program["tensors"]:
        for first, n, nbytes in t["tile_runs"]:
            if first <= tile < first + n:
                last = count - 1 if t["last"] is None else t["last"]
                on_tile.append((t["name"], nbytes, range(max(t["first"], 0), last + 1)))
    at = [sum(b for _, b, live in on_tile if point in live) for point in range(count)]
    peak = at.index(max(at))
    return {name: b for name, b, live in on_tile if peak in live}


def _rows(browser, table):
    rows = browser.find_elements(By.CSS_SELECTOR, f"#{table} tr:not(:first-child)")
    return {r.find_element(By.CSS_SELECTOR, "td").text: r.find_elements(By.CSS_SELECTOR, "td")[2].text for r in rows}


def _column(browser, index):
    cells = browser.find_elements(By.CSS_SELECTOR, f"#operations-table tbody tr td:nth-child({index})")
    return [int(c.text.replace(",", "")) for c in cells]


def test_tutorial_cnn_report_in_chromium(browser, profile, artifacts):
    path = profile.save_html(artifacts / "tutorial_cnn.html", title="tutorial CNN", samples_per_run=BATCH)
    _open(browser, path)
    assert _errors(browser) == []
    summary = browser.find_element(By.ID, "summary-body").text
    program = profile.programs["train"]
    assert f"{program['total_cycles']:,}" in summary and "samples/s" in summary
    assert f"FLOPs utilisation {100 * program['flops_utilisation']:.1f}% of the AMP peak" in summary
    # The main plot's bars, one per step (the range slider below draws a small copy).
    bars = browser.find_elements(By.CSS_SELECTOR, "#timeline-chart .cartesianlayer .subplot.xy .barlayer .point")
    assert len(bars) == len(program["steps"])
    _screenshot(browser, "summary", artifacts / "summary.png")
    _screenshot(browser, "timeline", artifacts / "timeline.png")

    # The tile holding the most tensors: clicking it lists exactly those tensors.
    on_tile = {}
    for t in program["tensors"]:
        for first, count, _ in t["tile_runs"]:
            for tile in range(first, first + count):
                on_tile.setdefault(tile, set()).add(t["name"])
    tile = max(on_tile, key=lambda k: (len(on_tile[k]), -k))
    _click_tile(browser, tile)
    assert set(_rows(browser, "tile-tensors")) == on_tile[tile]
    assert f"Tile {tile}:" in browser.find_element(By.ID, "tile-detail").text
    # The tensors live at the tile's peak, and the live-at-peak bar's categories add up to the heat map's peak:
    # those tensors, the alignment and gaps the allocator left between them, vertex state and code.
    live = _live_at_peak(program, tile)
    shown = _rows(browser, "tile-peak-tensors")
    assert shown == {name: f"{b:,}" for name, b in live.items()}
    bars = dict(browser.execute_script('return document.getElementById("tile-chart").data.map(t => [t.name, t.x[0]])'))
    memory = program["memory"]
    assert sum(bars.values()) == memory["tensors"][tile] + memory["vertex_state"][tile] + memory["code"][tile]
    assert 0 <= bars.get("alignment and gaps", 0) == memory["tensors"][tile] - sum(live.values())
    assert sum(b for c, b in bars.items() if c in CATEGORIES) == sum(live.values())
    _screenshot(browser, "memory", artifacts / "tile_memory.png")

    # Sorting the operation table by memory bytes, then back by cycles.
    browser.find_element(By.CSS_SELECTOR, '#operations-table th[data-sort="memory_bytes"]').click()
    memory = _column(browser, 9)
    assert memory == sorted(memory, reverse=True) and memory[0] > 0
    browser.find_element(By.CSS_SELECTOR, '#operations-table th[data-sort="cycles"]').click()
    cycles = _column(browser, 5)
    assert cycles == sorted(cycles, reverse=True)
    modules = {c.text for c in browser.find_elements(By.CSS_SELECTOR, "#operations-table tbody tr td:first-child")}
    assert {"model.conv1", "model.conv2", "model.fc1"} <= modules
    # Every node a fused compute set computes has its row (module, role, op), not only the node that reads the
    # expression: the momentum's scaling and sum fused into each optimizer update among them.
    table = {
        tuple(c.text for c in r.find_elements(By.CSS_SELECTOR, "td")[:3])
        for r in browser.find_elements(By.CSS_SELECTOR, "#operations-table tbody tr")
    }
    fused = {(o["module"], o["role"], o.get("aten") or o["op"]) for s in program["steps"] for o in s.get("fused", ())}
    assert ("model.fc1", "optimizer", "mul") in fused and fused <= table
    _screenshot(browser, "operations", artifacts / "operations.png")
    assert _errors(browser) == []


def test_comparison_view_in_chromium(browser, profile, artifacts, tmp_path):
    before = json.loads(profile.to_json())
    before["programs"]["train"]["total_cycles"] *= 2
    (tmp_path / "before.json").write_text(json.dumps(before))
    path = profile.save_html(artifacts / "compare.html", compare=tmp_path / "before.json", compare_title="before")
    _open(browser, path)
    table = browser.find_element(By.ID, "compare-table").text
    assert "-50.0%" in table
    assert browser.find_elements(By.CSS_SELECTOR, "#compare-chart .barlayer .point")
    _screenshot(browser, "compare", artifacts / "compare.png")
    assert _errors(browser) == []


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        out = self.fc(x).squeeze(-1)
        return out, torch.nn.functional.mse_loss(out, y)


def _replica_bars(browser):
    """The Replicas chart's bars as [lane, name, start, cycles]."""
    return browser.execute_script(
        """return document.getElementById("replicas-chart").data
            .flatMap(t => t.y.map((lane, i) => [lane, t.name, t.base[i], t.x[i]]));"""
    )


def test_replicated_training_shows_each_replicas_runs_and_the_all_reduce(browser, artifacts):
    net = _Regression()
    training = poptorch.trainingModel(
        net, poptorch.Options().replicationFactor(2), torch.optim.SGD(net.parameters(), lr=0.1)
    )
    training(torch.ones(4, 3), torch.ones(4))
    replication = training.profile.replication
    _open(browser, training.profile.save_html(artifacts / "replicas.html"))
    table = browser.find_element(By.ID, "replicas-table").text
    assert f"{replication['step_cycles']:,} = {replication['replica_step_cycles']:,} per replica" in table
    bars = _replica_bars(browser)
    expected = [[e["lane"], e.get("program", "all-reduce"), e["start"], e["cycles"]] for e in replication["timeline"]]
    assert sorted(bars) == sorted(expected)
    assert {"replica 0", "replica 1", "all-reduce"} == {lane for lane, *_ in bars}
    _screenshot(browser, "replicas", artifacts / "replicas.png")
    assert _errors(browser) == []


def test_replicated_inference_shows_each_replicas_runs_without_a_collective(browser, artifacts):
    inference = poptorch.inferenceModel(_Regression(), poptorch.Options().replicationFactor(2).deviceIterations(2))
    inference(torch.ones(4, 3), torch.ones(4))
    replication = inference.profile.replication
    _open(browser, inference.profile.save_html(artifacts / "replicas_inference.html"))
    table = browser.find_element(By.ID, "replicas-table").text
    assert f"Cycles per inference call (no collective) {replication['step_cycles']:,}" in table
    bars = _replica_bars(browser)
    assert sorted(bars) == sorted([[e["lane"], e["program"], e["start"], e["cycles"]] for e in replication["timeline"]])
    assert {lane for lane, *_ in bars} == {"replica 0", "replica 1"}
    assert _errors(browser) == []


def test_the_summary_gives_the_bytes_in_streaming_memory(browser, artifacts):
    g = popir.Graph("main")
    x = g.add_input("x", (4, 8), "float32")
    w = g.add_input("w", (8, 8), "float32", kind="parameter")
    g.output("y", x @ w)
    profile = popsim.compile(g, popsim.Target.small(), remote={"w"}).profile
    _open(browser, profile.save_html(artifacts / "streaming.html"))
    summary = browser.find_element(By.ID, "summary-body").text
    assert f"Streaming memory {8 * 8 * 4:,} bytes off the tiles" in summary
    assert f"{8 * 8 * 4} in streaming memory" in profile.summary()
    assert _errors(browser) == []


def test_timeline_has_a_lane_per_ipu_on_a_two_ipu_device(browser, artifacts):
    g = popir.Graph("two_ipus")
    x = g.add_input("x", (8, 16), "float32")
    w = g.add_input("w", (16, 16), "float32", kind="parameter")
    with g.placed((0, 0)):
        h = popir.ops.relu(x @ w)
    with g.placed((1, 1)):
        g.output("y", h @ w)
    exe = popsim.compile(g, popsim.Device(popsim.Target.small(), 2))
    _open(browser, exe.profile.save_html(artifacts / "two_ipus.html"))
    lanes = browser.execute_script('return document.getElementById("timeline-chart").data.map(t => t.name)')
    assert {"compute IPU 0", "compute IPU 1"} <= set(lanes)
    assert any(lane.startswith("exchange IPU 0+1") for lane in lanes)
    assert _errors(browser) == []


STREAMED = 64  # input features: transfers long enough to see on the I/O tiles' lane


class _PhasedStreamer(torch.nn.Module):
    """Blocks A and B (phase 0, on IPUs 0 and 1) both read the input, C (phase 1) adds them; the input and
    output stream through the I/O tiles."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(STREAMED, 8), torch.nn.Linear(STREAMED, 8)

    def forward(self, x):
        x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.OverlapDeviceIterationLoop)
        with poptorch.Block("A"):
            u = torch.relu(self.a(x))
        with poptorch.Block("B"):
            v = torch.relu(self.b(x))
        with poptorch.Block("C"):
            return poptorch.set_overlap_for_output(u + v, poptorch.OverlapMode.OverlapDeviceIterationLoop)


def _call_bars(browser):
    """The call timeline's bars as [lane, name, start, cycles]."""
    return browser.execute_script(
        """return document.getElementById("call-chart").data
            .flatMap(t => t.y.map((lane, i) => [lane, t.name, t.base[i], t.x[i]]));"""
    )


def test_call_timeline_draws_the_phases_and_the_io_tiles_transfers_and_memory(browser, artifacts):
    strategy = poptorch.SerialPhasedExecution(poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")), "C")
    strategy.phase(0).ipus(0, 1)
    strategy.phase(1).ipus(0)
    options = poptorch.Options().deviceIterations(4).logCycleCount(True).setExecutionStrategy(strategy)
    options.TensorLocations.numIOTiles(32)
    inference = poptorch.inferenceModel(_PhasedStreamer(), options)
    inference(torch.rand(4 * 64, STREAMED))
    program = inference.profile.programs["inference"]
    _open(browser, inference.profile.save_html(artifacts / "call_timeline.html"))
    table = browser.find_element(By.ID, "call-table").text
    assert f"Cycles of the last call {inference.cycleCount():,}" in table
    assert f"scheduled {program['phases']['total_cycles']:,}" in table
    assert f"{inference.cycleCount():,} overlapped (32 I/O tiles)" in table
    bars = _call_bars(browser)
    assert len(bars) == sum(len(e["lanes"]) for e in program["run_timeline"]["intervals"])
    assert max(start + cycles for _, _, start, cycles in bars) == inference.cycleCount()
    io_lane, ipu0, ipu1 = "replica 0 IPU 0 I/O tiles", "replica 0 IPU 0 compute", "replica 0 IPU 1 compute"
    links = {"replica 0 IPU-Link 0->1", "replica 0 IPU-Link 1->0"}  # B's input, C's read of B's result
    assert {lane for lane, *_ in bars} == {io_lane, ipu0, ipu1} | links
    # Phase 0's two IPUs start together in every run; transfers on the I/O tiles overlap the compute tiles' work.
    # (IPU 1's work starts with its copy of the input over the link from IPU 0.)
    phase0 = [(lane, start) for lane, name, start, _ in bars if name == "phase 0 forward"]
    starts = {start for lane, start in phase0 if lane == ipu0}
    assert len(starts) == 4 and starts <= {start for lane, start in phase0 if lane == ipu1}
    assert starts <= {start for lane, start in phase0 if lane == "replica 0 IPU-Link 0->1"}
    transfers = [(s, s + c) for lane, name, s, c in bars if lane == io_lane and name in ("I/O load", "I/O store")]
    computing = [(s, s + c) for lane, name, s, c in bars if lane == ipu1]
    assert any(a < d and c < b for a, b in transfers for c, d in computing)
    _screenshot(browser, "call", artifacts / "call_timeline.png")
    # The I/O tiles' memory: the marked input and output, spread over the 32 I/O tiles.
    held = program["io_tiles"]
    assert "I/O tiles: 32 on IPU 0" in browser.find_element(By.ID, "io-tiles").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#io-tile-tensors tr:not(:first-child)")
    assert {r.find_element(By.CSS_SELECTOR, "td").text for r in rows} == {t["name"] for t in held["tensors"]}
    chart = browser.execute_script('return document.getElementById("io-tiles-chart").data.map(t => t.y)')
    assert [sum(column) for column in zip(*chart)] == held["memory"]
    _screenshot(browser, "memory", artifacts / "io_tiles.png")
    assert _errors(browser) == []


class _TwoStages(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            x = torch.relu(self.a(x))
        with poptorch.Block("B", ipu_id=1):
            return self.b(x)


def test_call_timeline_draws_a_pipeline_s_copies_and_lists_each_ipu_s_bubbles(browser, artifacts):
    options = poptorch.Options().deviceIterations(4).logCycleCount(True)
    inference = poptorch.inferenceModel(_TwoStages(), options)
    inference(torch.rand(4 * 2, 8))
    schedule = inference.profile.programs["inference"]["schedule"]
    _open(browser, inference.profile.save_html(artifacts / "pipeline_timeline.html"))
    table = browser.find_element(By.ID, "call-table").text
    idle = schedule["bubble_cycles"]
    assert f"Pipeline bubbles IPU 0 idle {idle[0]:,}, IPU 1 idle {idle[1]:,}" in table
    # The activations cross from IPU 0 to IPU 1 on the link, micro-batch by micro-batch.
    links = [bar for bar in _call_bars(browser) if bar[0] == "replica 0 IPU-Link 0->1"]
    assert len(links) == 4

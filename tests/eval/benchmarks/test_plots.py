"""The README's pictures: each PNG is written and holds the points of the rows it was given."""
import pytest

pytest.importorskip("matplotlib")

from eval.benchmarks import functional, plots, recipes  # noqa: E402
from eval.code_eval import CodeRow, TaskResult  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_frontier_draws_every_point_on_each_text_and_the_pass_panel(tmp_path):
    points = [plots.Point("q4", 338, {"code": 0.05, "prose": 0.14}, pass_diff=-1.6),
              plots.Point("Q4_0", 409, {"code": 0.068, "prose": 0.19}, llama_cpp=True, pass_diff=-3.0),
              plots.Point("q8", 638, {"code": 0.0008, "prose": 0.0016})]
    drawn = plots.frontier(points, tmp_path / "f.png")
    assert drawn["code"] == [(338, 0.05), (409, 0.068), (638, 0.0008)]
    assert drawn["prose"] == [(338, 0.14), (409, 0.19), (638, 0.0016)]
    assert drawn["pass"] == [(338, -1.6), (409, -3.0)]  # only the points with a pass rate
    assert (tmp_path / "f.png").read_bytes().startswith(PNG)


def test_speed_draws_a_bar_per_row(tmp_path):
    bars = plots.speed([("q4", 72, 66, 78, False), ("llama.cpp Q4_0", 61, 58, 64, True)], tmp_path / "s.png")
    assert bars == [(0.0, 72.0), (1.0, 61.0)] and (tmp_path / "s.png").read_bytes().startswith(PNG)


def test_the_recipes_run_draws_its_own_rows(tmp_path):
    made = {"fast": {"mib": 439, "seconds": 44}, "q4": {"mib": 338, "seconds": 107}}
    peers = {"q4_0": "m-q4_0.gguf"}
    fidelity = {(n, t): {"kld_mean": k} for n, k in (("fast", 0.07), ("q4", 0.05), ("m-q4_0.gguf", 0.068))
                for t in ("code", "prose")}
    speed = {"fast": {"decode_tps": [74, 73, 78]}, "q4": {"decode_tps": [72, 66, 78]},
             "m-q4_0.gguf": {"decode_tps": [61, 58, 64], "size_mib": 409}}
    drawn = recipes.plot(["fast", "q4"], made, fidelity, speed, peers, tmp_path, "2026-12-06, a CPU, 2 threads")
    assert drawn["frontier"]["code"] == [(439, 0.07), (338, 0.05), (409, 0.068)]
    assert drawn["speed"] == [(0.0, 74.0), (1.0, 72.0), (2.0, 61.0)]
    assert all((tmp_path / f).read_bytes().startswith(PNG) for f in ("frontier.png", "speed.png"))


def test_the_functional_run_draws_size_kld_and_pass_rate(tmp_path):
    def row(name, passed, text, paired=None):
        r = CodeRow(name, [TaskResult(f"t{i}", p, "", 1) for i, p in enumerate(passed)], 1.0)
        r.text, r.paired = text, paired or {}
        return r

    text = {"mib": 338, "code": {"kld_mean": 0.06}, "prose": {"kld_mean": 0.16}}
    rows = [row("demo", [True, True, False, False], {}),
            row("q4", [True, False, False, False], text, {"diff": -0.25}),
            row("m-q4_0.gguf", [True, True, False, False], {**text, "mib": 409, "format": "llama.cpp Q4_0"}, {"diff": 0.0})]
    drawn = functional.plot(rows, tmp_path / "f.png")
    assert drawn["pass"] == [(338, -25.0), (409, 0.0)] and drawn["code"] == [(338, 0.06), (409, 0.06)]
    assert [functional.row_label(r) for r in rows] == ["demo", "q4", "llama.cpp Q4_0"]  # a GGUF by its type

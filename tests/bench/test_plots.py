"""The bench figures render from result rows shaped like the real ones."""
from tandem.bench import plots
from tandem.bench.metrics import RequestRecord, record_dict, summarize


def rows():
    out = []
    for system in ("a", "b"):
        for rate in (1.0, 2.0):
            recs = [RequestRecord("rt", 0.0, [0.1 * rate, 0.2 * rate, 0.35 * rate], 3, 0.4 * rate)]
            out.append({"system": system, "rate": rate, "attain_apt": 0.5, "attain_bros": 0.9,
                        "summary": summarize(recs, 1.0), "records": [record_dict(r) for r in recs],
                        "be": {"tokens_per_s": 10 * rate}})
    return out


def test_figures_are_written(tmp_path):
    rs = rows()
    plots.attainment_vs_rate(rs, tmp_path / "a.png", "t")
    plots.latency_cdfs(rs, tmp_path / "c.png", "t")
    plots.rt_latency_vs_be_throughput(rs, tmp_path / "r.png", "t")
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("a.png", "c.png", "r.png"))


def test_record_dict_gaps():
    d = record_dict(RequestRecord("rt", 1.0, [1.5, 1.75, 2.0], 3, 2.0))
    assert d["ttft"] == 0.5 and d["gaps"] == [0.25, 0.25] and d["latency"] == 1.0 and d["sent"] == 1.0

"""bench sim-apt's summary over several traces: ratios to FCFS per trace, then mean and range."""
from tandem.bench.sim_apt import print_tables


def test_samples_table_averages_per_trace_ratios(capsys):
    samples = [{"sample": None, "rates": {"fcfs": 2.0, "fcfs-prefill-first": 4.0, "aptserve": 3.0}},
               {"sample": 1, "rates": {"fcfs": 1.0, "fcfs-prefill-first": 2.0, "aptserve": 2.5}}]
    out = {"target": 0.9, "datasets": {"sharegpt": {
        "slo": {"ttft_s": 1.0, "tbt_s": 1.0}, "ablation": [], "samples": samples,
        "effective": {s: {"rate": r} for s, r in samples[0]["rates"].items()}}}}
    print_tables(out)
    lines = {ln.split("|")[1].strip(): ln for ln in capsys.readouterr().out.splitlines() if ln.count("|") > 6}
    # aptserve: 3/2 = 1.5x and 2.5/1 = 2.5x over FCFS -> mean 2.00x; over prefill-first 0.75x and 1.25x
    assert "| 3.00 | 2.50 | 2.75 | 2.00x (1.50-2.50) | 1.00x (0.75-1.25) |" in lines["aptserve"]
    assert "| 1.00x (1.00-1.00) |" in lines["fcfs"]

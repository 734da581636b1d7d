"""BROS's comparison table (bench/mixed.py::co_serving_targets) against hand-computed rows."""
import importlib.util
import json
from pathlib import Path

import pytest

from tandem.bench.mixed import co_serving_targets


def _row(system, rate, attain, mean, p50, be_rps, be_tps, str_keys=False):
    key = "50" if str_keys else 50
    return {"system": system, "rate": rate, "attain_bros": attain,
            "summary": {"rt": {"normalized_latency_mean_s": mean, "normalized_latency_s": {key: p50}}},
            "be": {"requests_per_s": be_rps, "tokens_per_s": be_tps}}


def test_ratios_use_the_mean_and_requests_per_second():
    rows = [_row("tandem-fcfs", 0.5, 0.05, 0.800, 0.250, 1.00, 40.0),
            _row("vllm-priority", 0.5, 0.02, 0.600, 0.300, 1.30, 52.0),
            # p50 only 40% lower, the mean (BROS's metric) 75% lower; BE 90% of requests, 80% of tokens
            _row("tandem-bros", 0.5, 0.60, 0.200, 0.150, 0.90, 32.0, str_keys=True)]
    [t] = co_serving_targets(rows)
    assert t["system"] == "tandem-bros" and t["rate"] == 0.5
    assert t["attainment_ratio"] == pytest.approx(12.0)
    assert t["norm_latency_mean_ratio"] == pytest.approx(0.25)
    assert t["norm_latency_p50_ratio"] == pytest.approx(0.6)
    assert t["norm_latency_mean_vs_peer"] == pytest.approx(1 / 3)
    assert t["be_requests_ratio"] == pytest.approx(0.9)
    assert t["be_tokens_ratio"] == pytest.approx(0.8)


def test_rates_are_matched_and_zero_baselines_do_not_divide():
    rows = [_row("tandem-fcfs", 0.25, 0.0, 0.5, 0.2, 1.0, 40.0), _row("tandem-fcfs", 0.75, 0.1, 1.0, 0.3, 0.5, 20.0),
            _row("tandem-rr", 0.75, 0.0, 1.5, 0.4, 0.25, 10.0), _row("tandem-bros", 0.25, 0.5, 0.25, 0.1, 1.0, 40.0)]
    got = {(t["system"], t["rate"]): t for t in co_serving_targets(rows)}
    assert set(got) == {("tandem-rr", 0.75), ("tandem-bros", 0.25)}
    assert got[("tandem-rr", 0.75)]["norm_latency_mean_ratio"] == pytest.approx(1.5)
    assert got[("tandem-rr", 0.75)]["attainment_ratio"] == pytest.approx(0.0)
    assert got[("tandem-bros", 0.25)]["attainment_ratio"] == float("inf")
    assert "norm_latency_mean_vs_peer" not in got[("tandem-bros", 0.25)]


def test_system_names_map_to_server_flags():
    from tandem.bench.online import tandem_args
    assert tandem_args("tandem") == ["--policy", "tandem", "--no-length-cap"]
    assert tandem_args("tandem-fcfs") == ["--policy", "fcfs"]
    assert tandem_args("tandem-no-lengths") == ["--policy", "tandem", "--tandem-off", "lengths", "--no-length-cap"]
    assert tandem_args("tandem-no-late") == ["--policy", "tandem", "--tandem-off", "late", "--no-length-cap"]
    assert tandem_args("tandem-no-overdue") == ["--policy", "tandem", "--tandem-off", "overdue", "--no-length-cap"]
    assert tandem_args("tandem-fcfs-no-prefix") == ["--policy", "fcfs", "--no-enable-prefix-caching"]
    assert tandem_args("tandem-recompute") == ["--policy", "tandem", "--preemption-mode", "recompute",
                                           "--no-length-cap"]
    assert tandem_args("tandem-tpot") == ["--policy", "tandem", "--slo-tbt-mean", "--no-length-cap"]
    assert tandem_args("tandem-fcfs-prefill-first") == ["--policy", "fcfs-prefill-first"]
    assert tandem_args("tandem-bros-bidir") == ["--policy", "bros", "--bidirectional-blocks"]
    assert tandem_args("tandem-aptserve-mixed-kv") == ["--policy", "aptserve", "--aptserve-mixed", "--kv-only"]
    assert tandem_args("tandem-aptserve-kv") == ["--policy", "aptserve", "--kv-only"]
    assert tandem_args("tandem-fcfs-f32w") == ["--policy", "fcfs", "--no-weight-blocks"]
    assert tandem_args("tandem-shed") == ["--policy", "tandem", "--shed-chats-after", "10", "--no-length-cap"]
    assert tandem_args("tandem-bros-shed3") == ["--policy", "bros", "--shed-chats-after", "3"]
    # the SLOs are numbers handed to the server as flags (no clock is read): 0.5 s -> "500.0" ms
    assert tandem_args("tandem-aptserve-mixed", {"ttft_s": 0.5, "tbt_s": 0.1}, 0.25) == [
        "--policy", "aptserve", "--aptserve-mixed", "--slo-ttft-ms", "500.0", "--slo-tbt-ms", "100.0",
        "--kv-cache-bytes", str(2**28)]


class _Called(Exception):
    """Stops a command at the point where it hands its arguments to the online bench."""


def _online_args(monkeypatch, run) -> dict:
    import tandem.bench.online as online

    def capture(args):
        raise _Called(vars(args))
    monkeypatch.setattr(online, "main", capture)
    with pytest.raises(_Called) as called:
        run()
    return called.value.args[0]


def test_the_peers_table_gives_the_online_bench_every_setting_its_cli_has(monkeypatch, tmp_path):
    """`bench table` calls the online bench with a hand-built namespace; every option that
    `bench online` parses (the reference: its own command line, defaults only) must be in it,
    or the table stops with an AttributeError part way through."""
    import argparse
    from tandem.bench import table
    from tandem.bench.__main__ import main
    cli = _online_args(monkeypatch, lambda: main(["online"]))
    from tandem.bench import peers
    monkeypatch.setattr(peers, "installed", lambda system: system == "tandem")
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    (tmp_path / "offline.json").write_text('{"rows": []}')
    built = _online_args(monkeypatch, lambda: table.run(argparse.Namespace(
        rates=[1.0, 2.0], duration=30.0, drain=60.0, search=None, skip_offline=True, out="peers_table.json")))
    assert set(cli) - {"cmd"} <= set(built), sorted(set(cli) - set(built))


def test_the_peers_table_without_the_offline_rows_it_reuses_stops_before_the_online_run(monkeypatch, tmp_path):
    """`bench table --skip-offline` with no offline.json beside its --out: it said so only after
    the online run (an hour at its defaults); it says so before starting it."""
    import argparse
    from tandem.bench import online, table
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    monkeypatch.setattr(online, "main", lambda args: pytest.fail("the online run started"))
    with pytest.raises(FileNotFoundError, match="--skip-offline: no offline results at"):
        table.run(argparse.Namespace(rates=[1.0, 2.0], duration=30.0, drain=60.0, search=None, skip_offline=True,
                                     out="peers_table.json"))


def _online_without_load(monkeypatch, tmp_path):
    """The online bench with its results dir at ``tmp_path`` and no model, trace, SLO calibration,
    request, judgement or plot: what is left is how it starts its servers and where it writes."""
    from tandem.bench import online

    async def run_trace(*a, **kw):
        return [], 1.0
    monkeypatch.setattr(online, "RESULTS", tmp_path)
    monkeypatch.setattr(online, "_setup", lambda args: (tmp_path, None))
    monkeypatch.setattr(online, "slo_for", lambda *a: {"ttft_s": 1.0, "tbt_s": 0.1})
    monkeypatch.setattr(online, "RateTraces", lambda *a, **kw: (lambda rate: []))
    monkeypatch.setattr(online, "server_counters", lambda url: {})
    monkeypatch.setattr(online, "run_trace", run_trace)
    monkeypatch.setattr(online, "judge", lambda system, rate, *a: {"system": system, "rate": rate})
    for quiet in ("print_row", "print_table"):
        monkeypatch.setattr(online, quiet, lambda *a, **kw: None)
    monkeypatch.setattr(online.plots, "attainment_vs_rate", lambda *a, **kw: None)
    monkeypatch.setattr(online.plots, "latency_cdfs", lambda *a, **kw: None)
    return online


def _online_run(out: str, systems: list[str]):
    """What `bench online --out OUT --systems SYSTEMS --rates 1` would parse, short and without a search."""
    import argparse
    return argparse.Namespace(systems=systems, rates=[1.0], requests=None, search=None, out=out, seed=0,
                              duration=1.0, drain=1.0, max_num_seqs=4, model="smollm2", kv_cache_gib=None,
                              devices=None, step_log=False)


def test_peers_not_installed_are_left_out_before_anything_runs(monkeypatch, tmp_path, capsys):
    """`bench online --systems tandem vllm` on a machine without vLLM measures tandem and writes
    it; starting the missing peer last used to raise and lose tandem's rows."""
    import contextlib
    from tandem.bench import peers
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path / "peers")
    assert peers.installed_only(["tandem", "tandem-bros", "vllm-priority", "llamacpp", "transformers"]) == [
        "tandem", "tandem-bros"]
    assert "vllm-priority, llamacpp, transformers; left out" in capsys.readouterr().out
    started = []

    @contextlib.contextmanager
    def start(system, *a, **kw):
        if not peers.installed(system):
            raise FileNotFoundError(system)
        started.append(system)
        yield "http://127.0.0.1:1"
    online = _online_without_load(monkeypatch, tmp_path)
    monkeypatch.setattr(online, "start", start)
    online.main(_online_run("o.json", ["vllm", "tandem"]))
    assert started == ["tandem"]
    assert [r["system"] for r in json.loads((tmp_path / "o.json").read_text())["rows"]] == ["tandem"]


def test_a_figure_without_matplotlib_is_left_out_with_a_line(monkeypatch, tmp_path, capsys):
    """Without the bench extra a run still gets to its table: the figure says it was left out."""
    import sys
    from tandem.bench import plots
    monkeypatch.setitem(sys.modules, "matplotlib", None)         # import matplotlib -> ModuleNotFoundError
    plots.attainment_vs_rate([{"system": "a", "rate": 1.0, "attain_apt": 1, "attain_bros": 1}],
                             tmp_path / "a.png", "t")
    assert not (tmp_path / "a.png").exists()
    assert "no attainment_vs_rate plot: matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
    (["sim", "--rates", "1", "0"], "argument --rates: must be above 0, got 0"),
    (["sim", "--num-requests", "0"], "argument --num-requests: must be at least 1, got 0"),
    (["overhead", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["offline", "--max-tokens", "1.5"], "argument --max-tokens: must be a whole number, got 1.5"),
    (["offline", "--skip", "vllm"], "argument --skip: invalid choice: 'vllm'"),                  # skipped nothing
    (["kernels", "--cpu", "--shapes", "foo"], "argument --shapes: invalid choice: 'foo'"),        # a KeyError
    (["sim-apt", "--search", "2", "1"], "--search: LO and HI must be 0 < LO < HI, got 2 1"),
    (["sim-apt", "--search-long", "0", "1"], "--search-long: LO and HI must be 0 < LO < HI, got 0 1"),
    (["online", "--requests", "3", "--search", "1", "2"], "--requests runs each rate on a fresh server"),
    (["sim-mell", "--tbt-ms", "-50"], "argument --tbt-ms: must be above 0, got -50"),            # looped for ever
    (["sim-tandem", "--slower", "0"], "argument --slower: must be above 0, got 0"),              # a traceback
    (["chat-under-batch", "--idle", "0"], "argument --idle: must be at least 1, got 0"),         # lost the run
    (["online", "--slo-ttft-ms", "0"], "argument --slo-ttft-ms: must be above 0, got 0")])       # dropped
def test_nonsense_sizes_are_refused_before_any_work(argv, said, capsys):
    """Counts, sizes and search ranges that cannot mean anything are refused as argparse refuses
    a bad flag (exit 2, the reason on stderr), where they used to run silently (a simulation of
    no requests, a search whose HI is below its LO) or raise (a NameError)."""
    from tandem.bench.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_a_missing_input_is_one_line_not_a_traceback(monkeypatch, tmp_path):
    """An error a command meets before any work (its input file missing) ends it with one line
    naming the command; the traceback only with TANDEM_BENCH_TRACEBACK=1."""
    from tandem.bench.__main__ import main
    missing = str(tmp_path / "online.json")
    with pytest.raises(SystemExit) as e:
        main(["sim-validate", "--real", missing])
    assert e.value.code == f"python -m bench sim-validate: FileNotFoundError: [Errno 2] No such file or directory: " \
                          f"'{missing}'"
    monkeypatch.setenv("TANDEM_BENCH_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        main(["sim-validate", "--real", missing])


def test_a_missing_predictor_is_one_line_and_status_1(tmp_path, capsys):
    from tandem.predictor.__main__ import main
    assert main(["predict", "hello", "--path", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m predictor predict: no length predictor in") and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["eval", "--limit", "0"])
    assert e.value.code == 2 and "--limit: must be 1 or more, got 0" in capsys.readouterr().err


def test_validating_the_simulator_against_a_run_without_fcfs_rows_says_so(tmp_path, monkeypatch):
    """sim-validate replays a run's FCFS rows: a results file without any is an error naming
    what it needs, not an empty table."""
    import json
    from tandem.bench import sim_cli
    from tandem.bench.__main__ import main
    monkeypatch.setattr(sim_cli, "RESULTS", tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"rows": [{"system": "tandem", "rate": 1.0}]}))
    with pytest.raises(SystemExit) as e:
        main(["sim-validate", "--real", "run.json"])
    assert str(e.value.code).startswith("python -m bench sim-validate: ValueError: run.json holds no tandem-fcfs rows")


def test_one_slo_given_without_the_other_is_refused():
    """``--slo-ttft-ms`` alone was dropped without a word: both SLOs were calibrated."""
    from types import SimpleNamespace

    from tandem.bench.online import slo_for
    for ttft, tbt in ((2000.0, None), (None, 300.0)):
        with pytest.raises(SystemExit, match="give both --slo-ttft-ms and --slo-tbt-ms, or neither"):
            slo_for(SimpleNamespace(slo_ttft_ms=ttft, slo_tbt_ms=tbt), None, None)


@pytest.mark.parametrize("command", ["sim-alise", "sim-tandem"])
def test_an_unknown_system_is_named_before_any_work(command):
    """A system name the simulator does not know was a bare ``KeyError: 'foo'`` (after the
    tokenizer had loaded); now the names it knows, before anything runs."""
    from tandem.bench.__main__ import main
    with pytest.raises(SystemExit) as e:
        main([command, "--systems", "fcfs", "foo", "--num-requests", "1", "--rates", "1"])
    assert str(e.value.code).startswith("--systems: foo not one of fcfs, "), e.value.code


def test_a_search_that_hit_an_end_of_its_range_says_it_is_a_bound():
    """Effective throughput from a search whose highest probe still met the target is at least
    that rate (it printed "8.00 req/s" as if found), and below the lowest where even that missed."""
    from tandem.bench.metrics import effective_throughput, rate_text
    always, never, knee = (lambda r: 1.0), (lambda r: 0.0), (lambda r: 1.0 if r <= 3 else 0.0)
    assert rate_text(effective_throughput(always, 1, 8)[0], 1, 8) == ">= 8.00"
    assert rate_text(effective_throughput(never, 1, 8)[0], 1, 8) == "< 1.00"
    found = effective_throughput(knee, 1, 8)[0]
    assert 3 * 0.95 <= found <= 3 and rate_text(found, 1, 8) == f"{found:.2f}"


def test_the_peers_table_takes_tandems_offline_number_from_its_server_row(tmp_path):
    """Every offline row whose label began with "tandem" mapped to tandem, the last one winning:
    the JSON-schema row, or the in-process one, could stand as the server's throughput."""
    from tandem.bench import table
    off = {"rows": [{"system": "tandem server (float32, cpu:1, 64 streams)", "tok_s": 200.0},
                    {"system": "tandem (float32, cpu:1)", "tok_s": 240.0},
                    {"system": "tandem (float32, cpu:1, JSON schema)", "tok_s": 180.0}]}
    on = {"effective_throughput": [], "slo": {"ttft_s": 1.0, "tbt_s": 0.2},
          "rows": [{"system": "tandem", "rate": 1.0, "attain_bros": 1.0, "attain_apt": 1.0, "summary": {}}]}
    table.write_table(off, on, [1.0], tmp_path / "peers_table.json")
    assert json.loads((tmp_path / "peers_table.json").read_text())["offline_tok_s"] == {"tandem": 200.0}


def test_a_result_of_the_wrong_kind_is_named_not_a_key_error(tmp_path):
    """A start-up profile that is some other JSON (``steps --profile``), a result of another bench
    (``bros-bound --real``): a bare ``KeyError: 'samples'`` / ``'be'`` before."""
    from tandem.bench.__main__ import main
    other, log = tmp_path / "online.json", tmp_path / "steps.jsonl"
    other.write_text(json.dumps({"slo": {}, "rows": []}))
    log.touch()
    with pytest.raises(SystemExit) as e:
        main(["steps", str(log), "--profile", str(other), "--out", str(tmp_path / "out.json")])
    assert str(e.value.code).startswith(f"--profile: {other} is not a start-up profile"), e.value.code
    with pytest.raises(SystemExit) as e:
        main(["bros-bound", "--real", str(other)])
    assert str(e.value.code).startswith(f"--real: {other} is not a `bench mixed` result"), e.value.code


# cheap runs of the commands that write plots or nothing beside their result: argv, and the tails
# their side files take after the result's stem
CHEAP = {"overhead": (["overhead", "--candidates", "4", "--repeats", "1", "--waiting", "2", "--steps", "1"], []),
         "sim": (["sim", "--num-requests", "4", "--rates", "1"], ["attainment.png"]),
         "sim-mixed": (["sim-mixed", "--num-requests", "4", "--rates", "1", "--policies", "fcfs"],
                       ["attainment.png", "rt_vs_be.png"]),
         "sim-mell": (["sim-mell", "--duration", "20", "--rates", "0.5", "--cvs", "1", "--traces", "sharegpt",
                       "--policies", "mell", "lb"], ["timeline.png"])}


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("command", CHEAP)
def test_a_result_and_its_plots_go_where_out_says(command, monkeypatch, tmp_path):
    """overhead, sim and sim-mixed took no --out: each wrote its fixed name into the results dir,
    over the reference result kept there; sim-mell's timeline plot went to the results dir's root
    whatever --out said."""
    from tandem.bench import output, sim_cli, sim_mell
    from tandem.bench.__main__ import main
    for module in (output, sim_cli, sim_mell):          # each module that held its own name for the dir
        monkeypatch.setattr(module, "RESULTS", tmp_path, raising=False)
    argv, sides = CHEAP[command]
    main(argv + ["--out", "sub/x.json"])
    plots = sides if importlib.util.find_spec("matplotlib") else []
    assert _files(tmp_path) == sorted(["sub/x.json"] + [f"sub/x_{tail}" for tail in plots])


def test_our_servers_log_and_data_go_beside_the_result(monkeypatch, tmp_path):
    """Every server the online bench started logged to the results dir's root (tandem-server.log,
    each start over the last one's log) and kept its data dir there, whatever --out said."""
    import contextlib
    online = _online_without_load(monkeypatch, tmp_path)
    started = []

    @contextlib.contextmanager
    def serve(cmd, port, *, log_path=None, **kw):
        started.append((log_path, Path(cmd[cmd.index("--data-dir") + 1]).parent))
        yield "http://127.0.0.1:1"
    monkeypatch.setattr(online, "serve", serve)
    sub = tmp_path / "sub"
    sub.mkdir()                 # made by the _setup left out
    online.main(_online_run("sub/o.json", ["tandem-fcfs", "tandem"]))
    assert started == [(sub / "o_tandem-fcfs.log", sub), (sub / "o_tandem.log", sub)]
    assert _files(tmp_path) == ["sub/o.json"]


def test_the_peers_table_reuses_the_offline_rows_in_its_folder_and_writes_beside_its_out(monkeypatch, tmp_path):
    """`table` took no --out: its table, markdown and online rows went to fixed names in the
    results dir; --skip-offline reads offline.json in --out's folder (results/offline.json by
    default, where `bench offline` writes)."""
    from tandem.bench import online, peers, table
    from tandem.bench.__main__ import main
    monkeypatch.setattr(table, "RESULTS", tmp_path)
    monkeypatch.setattr(peers, "installed", lambda system: system == "tandem")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "offline.json").write_text(json.dumps(
        {"rows": [{"system": "tandem server (float32, cpu:1, 64 streams)", "tok_s": 200.0}]}))
    rows = [{"system": "tandem", "rate": 1.0, "attain_bros": 1.0, "attain_apt": 1.0, "summary": {}}]
    monkeypatch.setattr(online, "main", lambda args: Path(args.out).write_text(json.dumps(
        {"effective_throughput": [], "slo": {"ttft_s": 1.0, "tbt_s": 0.2}, "rows": rows})))
    main(["table", "--skip-offline", "--rates", "1", "2", "--out", "sub/t.json"])
    assert _files(tmp_path) == ["sub/offline.json", "sub/t.json", "sub/t.md", "sub/t_online.json"]
    assert json.loads((tmp_path / "sub" / "t.json").read_text())["offline_tok_s"] == {"tandem": 200.0}


@pytest.mark.parametrize("where", ["in the results dir", "a path"])
def test_the_simulator_reads_the_cost_model_profile_wrote_where_fitted_says(where, monkeypatch, tmp_path):
    """`profile --out` wrote a fitted cost model that the fitted preset, sim-validate and
    bros-bound never read (they read the default name): `--fitted` names it, and the simulation
    runs with its coefficients, not the default file's."""
    from tandem.bench import output, sim_cli
    from tandem.bench.__main__ import main
    default = json.loads((sim_cli.COST_FILE).read_text())
    mine = dict(default, cost={k: 2 * v for k, v in default["cost"].items()})
    for module in (output, sim_cli):
        monkeypatch.setattr(module, "RESULTS", tmp_path, raising=False)
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    name = "mine.json" if where == "in the results dir" else str(tmp_path / "mine.json")
    main(["sim", "--preset", "fitted", "--fitted", name, "--num-requests", "4", "--rates", "1", "--out", "s.json"])
    got = json.loads((tmp_path / "s.json").read_text())["cost"]
    assert {k: got[k] for k in mine["cost"]} == mine["cost"] != default["cost"]
    with pytest.raises(SystemExit, match="bench profile --out other.json"):
        main(["sim", "--preset", "fitted", "--fitted", "other.json", "--num-requests", "4", "--rates", "1"])

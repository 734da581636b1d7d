"""python -m bench table: the whole peers comparison in one command.

Runs `offline` (every installed system) and `online` (tandem, vLLM, llama.cpp,
transformers serve: the same ShareGPT trace at two rates, plus an effective-
throughput search per system), then joins them into one JSON table (--out, default
results/peers_table.json) and its markdown beside it (peers_table.md). The offline rows are
offline.json in --out's folder (what `bench offline` writes by default, reused with
--skip-offline), the online rows <out>_online.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.bench.output import RESULTS, beside

ONLINE_SYSTEMS = ["tandem", "vllm", "llamacpp", "transformers"]
# offline row labels -> online system names: each a server, as the online rows are (the offline
# bench's in-process tandem rows, with log probabilities or a JSON schema, are not)
OFFLINE_KEYS = {"tandem server": "tandem", "vLLM CPU server (float32)": "vllm", "llama.cpp": "llamacpp",
                "transformers serve": "transformers"}


def run(args) -> None:
    from tandem.bench.offline import main as offline
    from tandem.bench.online import main as online
    from tandem.bench.peers import installed_only
    systems = installed_only(ONLINE_SYSTEMS)
    out = RESULTS / args.out
    off, on = out.with_name("offline.json"), beside(out, "online.json")
    if args.skip_offline and not off.is_file():      # said before the online run's hour, not after it
        raise FileNotFoundError(f"--skip-offline: no offline results at {off} (`python -m bench offline` "
                                f"writes them)")
    if not args.skip_offline:
        offline(argparse.Namespace(num_prompts=64, max_tokens=128, dtype="float32", devices="cpu:1",
                                   skip=["hf_generate", "hf_cb", "vllm_bfloat16"], out=str(off)))
    online(argparse.Namespace(systems=systems, rates=args.rates, duration=args.duration, drain=args.drain,
                              seed=0, max_output=512, max_num_seqs=64, ttft_factor=10.0, tbt_factor=5.0,
                              slo_ttft_ms=None, slo_tbt_ms=None, search=args.search, search_metric="bros",
                              out=str(on), model="smollm2", held_out=False, kv_cache_gib=None,
                              devices=None, requests=None, step_log=False))
    write_table(json.loads(off.read_text()), json.loads(on.read_text()), args.rates, out)


def _offline_key(label: str) -> str | None:
    return next((v for k, v in OFFLINE_KEYS.items() if label.startswith(k)), None)


def _ms(d: dict, p: int) -> str:
    v = d.get(str(p), d.get(p))
    return f"{v * 1e3:.0f}" if v is not None and v == v else "-"


def write_table(off: dict, on: dict, rates: list[float], out: Path) -> str:
    """One row per system: offline tok/s, effective throughput, TTFT/TBT percentiles at each rate;
    the JSON to ``out``, the markdown beside it (``<out stem>.md``)."""
    tok_s = {_offline_key(r["system"]): r["tok_s"] for r in off["rows"] if _offline_key(r["system"])}
    eff = {e["system"]: e["effective_rps"] for e in on["effective_throughput"]}
    slo = on["slo"]
    head = ["system", "offline tok/s", "effective throughput (req/s)"]
    for rate in rates:
        head += [f"@{rate:g} req/s: attainment (TTFT & TPOT / TTFT & P99 TBT)",
                 f"@{rate:g}: TTFT p50/p90/p99 ms", f"@{rate:g}: TBT p50/p90/p99 ms"]
    lines = [f"SLOs: TTFT {slo['ttft_s'] * 1e3:.0f} ms, TBT {slo['tbt_s'] * 1e3:.0f} ms; effective throughput = "
             "highest rate with >= 90% of requests meeting TTFT & TPOT.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system in dict.fromkeys(r["system"] for r in on["rows"]):
        cells = [system, f"{tok_s[system]:.1f}" if system in tok_s else "-",
                 f"{eff[system]:.2f}" if system in eff else "-"]
        for rate in rates:
            r = next((x for x in on["rows"] if x["system"] == system and x["rate"] == rate), None)
            if r is None:
                cells += ["-"] * 3
                continue
            s = r["summary"].get("rt", {})
            cells += [f"{r['attain_bros']:.0%} / {r['attain_apt']:.0%}",
                      "/".join(_ms(s.get("ttft_s", {}), p) for p in (50, 90, 99)),
                      "/".join(_ms(s.get("tbt_s", {}), p) for p in (50, 90, 99))]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    out.write_text(json.dumps({"offline_tok_s": tok_s, "effective_rps": eff, "slo": slo, "rates": rates}, indent=2))
    print("\n" + text + f"wrote {out.with_suffix('.md')} and {out}")
    return text

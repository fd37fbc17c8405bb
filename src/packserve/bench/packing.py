"""`packserve bench packing`: the default mix in one packserve process against one packserve
process per catalog entry (`packserve serve --models NAME`), every model loaded by one request.

Memory is the resident set (VmRSS) of each server process and its children, from /proc. On a
GPU the same comparison would read device memory; this machine has none, so it is skipped.
"""

from __future__ import annotations

from packserve.bench.common import (
    CATALOG,
    EMBED_MODEL,
    MIB,
    RERANK_MODEL,
    Goal,
    Options,
    Report,
    packserve_argv,
    progress,
    ratio,
    request_body,
    rss_bytes,
    run_server,
    write_config,
)


def _measure(opts: Options, models: tuple[str, ...], log_name: str) -> dict[str, int]:
    config = write_config(opts.out / "work" / "packing.toml", opts)
    with run_server(packserve_argv("--config", str(config), "--models", ",".join(models)),
                    log=opts.out / "work" / f"{log_name}.log") as server, server.client() as c:
        idle = rss_bytes(server.pid)
        for m in models:
            path, body = request_body(m, max_tokens=4)
            c.post(path, json=body).raise_for_status()
        return {"idle_rss_bytes": idle, "loaded_rss_bytes": rss_bytes(server.pid)}


def run(opts: Options) -> Report:
    models = (EMBED_MODEL, RERANK_MODEL) if opts.quick else CATALOG
    report = Report("packing")
    with progress(opts, "packing", len(models) + 1) as advance:
        packed = _measure(opts, models, "packing-packed")
        advance(1, "one process, all models")
        separate: dict[str, dict[str, int]] = {}
        for m in models:
            separate[m] = _measure(opts, (m,), f"packing-{m}")
            advance(1, f"own process: {m}")
    total_separate = sum(s["loaded_rss_bytes"] for s in separate.values())
    rows: list[list[object]] = [
        ["one packserve process, all models", len(models),
         round(packed["idle_rss_bytes"] / MIB), round(packed["loaded_rss_bytes"] / MIB)],
        *[[f"own process: {m}", 1, round(s["idle_rss_bytes"] / MIB),
           round(s["loaded_rss_bytes"] / MIB)] for m, s in separate.items()],
        ["sum of the per-model processes", len(models),
         round(sum(s["idle_rss_bytes"] for s in separate.values()) / MIB),
         round(total_separate / MIB)],
    ]
    value = ratio(packed["loaded_rss_bytes"], total_separate)
    report.results = {
        "models": list(models), "packed": packed, "separate": separate,
        "total_separate_rss_bytes": total_separate, "ratio": value,
        "gpu": "no GPU on this machine: device memory and card count not measured",
        "tables": [{"columns": ["setup", "models", "RSS before requests (MiB)",
                                "RSS, all loaded (MiB)"], "rows": rows}],
    }
    report.goals = [Goal("packing: resident memory, one process / one process per model",
                         value, 0.5, "<=")]
    report.notes.append("GPU part (device memory, cards needed with default preallocation): "
                        "not measured, no GPU on this machine")
    return report

"""The tables of the model-loading benchmarks (gguf_load.json, from an earlier study, and
benchmarks/big_model.py); rendered by `python -m benchmarks tables`."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.tables.format import Result, markdown, num


def table_gguf_load(r: Sequence[Result]) -> list[str]:
    d = r[0]
    med = d["median_s"]
    labels = [
        ("gguf_first", "first start: prepare (metadata, tokenizer), dequantize, cache; build the CPU kernels"),
        ("gguf_cached", "cached start (`--quantization none`)"),
        ("gguf_quantized", "cached start, kept quantized (`--quantization auto`, the default)"),
        ("safetensors", "the same weights as a safetensors directory"),
        ("transformers_gguf", "transformers' own GGUF loader (`from_pretrained(gguf_file=...)`), for comparison"),
    ]
    rows = [(label, num(med[k])) for k, label in labels if k in med]
    return markdown(["start", f"seconds (median of {d['rounds']})"], rows)


def table_big_model(r: Sequence[Result]) -> list[str]:
    """Per node of the capped PP=4 run: its stage's load, the memory it was estimated to need, and
    what it and its cgroup held after loading and after the runs."""
    d = r[0]
    run = d["results"]["pp4_capped"]
    rows = []
    for n in run["nodes"]:
        after_load, after_runs = n["after_load"], n["after_runs"]
        rows.append(
            (
                f"node {n['node']}",
                num(n["loaded_s"] - n["stage_started_s"]),
                f"{num(n['estimate']['total'], 2)} GiB",
                f"{num(after_load['stage_rss_gib'], 2)} GiB",
                f"{num(after_runs['stage_rss_gib'], 2)} GiB",
                f"{num(after_runs['peak_gib'], 2)} of {num(d['cap_gib'])} GiB",
                str(after_runs["oom_kills"]),
            )
        )
    head = ["PP=4, 4 capped nodes", "stage load, s", "estimate", "RSS loaded", "RSS after runs", "cgroup peak", "OOM"]
    return markdown(head, rows)


def table_big_model_speed(r: Sequence[Result]) -> list[str]:
    """Greedy tokens/s of one stream and of several, PP=1 uncapped against PP=4 over the capped nodes."""
    d = r[0]
    res = d["results"]
    rows = []
    for key, label in (("pp1_uncapped", "PP=1, one node, no cap"), ("pp4_capped", "PP=4, four nodes of 2.5 GiB")):
        run = res[key]
        rows.append((label, num(run["ready_s"]), num(run["single"], 2), num(run["batch"], 2)))
    refused = res["pp1_capped"]
    rows.append(("PP=1 under one 2.5 GiB cap", "refused" if refused["refused"] else "not refused", "—", "—"))
    head = ["8B Q4_K_M, 2-core machine", "ready, s", "1 stream, tok/s", f"{d['streams']} streams, tok/s"]
    return markdown(head, rows)

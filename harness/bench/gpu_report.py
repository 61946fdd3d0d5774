"""`loadback bench gpu`'s figures: per-size rows, the printed table, and the targets the run
is judged against (ours over the pinned copy, ours over LMCache).
"""

from __future__ import annotations

import torch

from .common import fmt, median, print_table
from .gpu_contenders import CHUNK, LAYOUT

TARGETS = {"p7_ratio": 0.9, "p7_ratio_1k": 0.75, "p7_vs_lmcache": 1.3}


def size_row(n, times) -> dict:
    """One size's medians, GB/s and ratios (ours, cold, pickle and LMCache over the copy)."""
    nb = n * LAYOUT.bytes_per_token
    ms = {k: median(v) * 1e3 for k, v in times.items() if v}
    row = {"tokens": n, "bytes": nb, "samples": {k: len(v) for k, v in times.items()},
           "median_ms": ms, "gbps": {k: nb / (v / 1e3) / 1e9 for k, v in ms.items()},
           "samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
           "ours_over_copy": ms["copy"] / ms["ours-shm"]}
    if "ours-shm-cold" in ms:
        row["cold_over_copy"] = ms["copy"] / ms["ours-shm-cold"]
    if "ours-pickle" in ms:
        row["pickle_over_copy"] = ms["copy"] / ms["ours-pickle"]
    for k in ("lmcache", "lmcache-p256"):
        if k in ms:
            row[f"ours_over_{k}"] = ms[k] / ms["ours-shm"]
            row[f"{k}_over_copy"] = ms["copy"] / ms[k]
            if "ours-shm-cold" in ms:
                row[f"cold_over_{k}"] = ms[k] / ms["ours-shm-cold"]
    return row


def _end_to_end(rows) -> None:
    """Match (lookup, plus prepare_retrieve where it moved there) + load, per contender: what
    moving the round trip into the match phase costs there."""
    for r in rows:
        m = r.get("match_ms", {})
        r["match_plus_load_ms"] = {k: m[k] + r["median_ms"][k] for k in m
                                   if k in r["median_ms"]}
        e = r["match_plus_load_ms"]
        for k in ("lmcache", "lmcache-p256"):
            if k in e and "ours-shm" in e:
                r[f"e2e_ours_over_{k}"] = e[k] / e["ours-shm"]


def report(rows, notes, dev) -> dict:
    """Print the table and the targets; returns the run's figures for the JSON report."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    _end_to_end(rows)
    _print_table(rows, notes, name)
    out = _figures(rows)
    met = {k: (out[k] is not None and out[k] >= TARGETS[k]) for k in TARGETS}
    print()
    for k in TARGETS:
        v = out[k]
        print(f"{k:<15} = {fmt(v, 3):>7}   target >= {TARGETS[k]}   "
              f"{'MET' if met[k] else 'NOT MET'}")
    for k in ("cold_p7_ratio", "cold_p7_ratio_1k", "cold_p7_vs_lmcache", "e2e_p7_vs_lmcache"):
        print(f"{k:<19} = {fmt(out[k], 3):>7}")
    return {**out, "targets": {k: f">= {v}" for k, v in TARGETS.items()}, "targets_met": met,
            "device": name, "torch": torch.__version__, "layout": {
                "layers": LAYOUT.num_layers, "kv_heads": LAYOUT.num_heads,
                "head_dim": LAYOUT.head_dim, "dtype": LAYOUT.dtype_str, "chunk": CHUNK,
                "bytes_per_token": LAYOUT.bytes_per_token},
            "data_paths": notes, "rows": rows}


def _print_table(rows, notes, name: str) -> None:
    print(f"\nloadback bench gpu: {name}, KV 32 layers x 8 heads x 128 x K,V bf16 "
          f"({LAYOUT.bytes_per_token // 1024} KiB/token), chunk {CHUNK}, random slots; "
          "load: median ms (GB/s) from after the match phase until the bytes are in the "
          "slots; ratio = bytes/s over the pinned copy's")
    heads = ["contender"] + [(f"{r['tokens'] // 1024}k" if r["tokens"] % 1024 == 0
                              else str(r["tokens"])) + " tok" for r in rows]
    body = [[f"{k} ({notes[k]})"] + [f"{fmt(r['median_ms'][k])} ({fmt(r['gbps'][k], 1)})"
                                     if k in r["median_ms"] else "-" for r in rows]
            for k in notes]
    body.append(["ours-shm / copy"] + [fmt(r["ours_over_copy"], 3) for r in rows])
    body.append(["ours-shm-cold / copy"] + [fmt(r.get("cold_over_copy"), 3) for r in rows])
    body.append(["ours-pickle / copy"] + [fmt(r.get("pickle_over_copy"), 3) for r in rows])
    for k in ("lmcache", "lmcache-p256"):
        if k in notes:
            body.append([f"{k} / copy"] + [fmt(r.get(f"{k}_over_copy"), 3) for r in rows])
            body.append([f"ours-shm / {k} (speed)"] + [fmt(r.get(f"ours_over_{k}"), 3)
                                                      for r in rows])
            body.append([f"ours-shm-cold / {k} (speed)"] + [
                fmt(r.get(f"cold_over_{k}"), 3) for r in rows])
    for k in ("ours-shm", "ours-shm-cold", "lmcache", "lmcache-p256"):
        if k in notes:
            body.append([f"match phase ms: {k}"] + [fmt(r.get("match_ms", {}).get(k))
                                                    for r in rows])
    for k in ("lmcache", "lmcache-p256"):
        if k in notes:
            body.append([f"match+load, ours-shm / {k} (speed)"] + [
                fmt(r.get(f"e2e_ours_over_{k}"), 3) for r in rows])
    for k in ("ours-shm", "ours-shm-cold"):
        body.append([f"{k}: retrieve_into returned (ms)"] + [
            fmt(r.get(k.replace("-", "_") + "_returned_ms")) for r in rows])
    body.append(["samples (shm/pickle)"] + [f"{r['samples']['ours-shm']}/"
                                            f"{r['samples'].get('ours-pickle', 0)}"
                                            for r in rows])
    print_table(heads, body)


def _figures(rows) -> dict:
    """The judged figures: the worst ratio over the sizes (4k and up; 1k alone)."""
    big = [r for r in rows if r["tokens"] >= 4096]
    one_k = [r for r in rows if r["tokens"] == 1024]

    def worst(key, among):
        return min((r[key] for r in among if key in r), default=None)

    def worst_lmc(prefix):  # over sizes and both LMCache configurations (page 1, page 256)
        return min((r[f"{prefix}_{k}"] for r in rows for k in ("lmcache", "lmcache-p256")
                    if f"{prefix}_{k}" in r), default=None)

    return {"p7_ratio": worst("ours_over_copy", big),
            "p7_ratio_1k": one_k[0]["ours_over_copy"] if one_k else None,
            "p7_vs_lmcache": worst_lmc("ours_over"),
            "p7_vs_lmcache_page1": worst("ours_over_lmcache", rows),
            # the same figures for a load that sends its own prepare_retrieve (no early
            # prepare), and for match + load together
            "cold_p7_ratio": worst("cold_over_copy", big),
            "cold_p7_ratio_1k": one_k[0].get("cold_over_copy") if one_k else None,
            "cold_p7_vs_lmcache": worst_lmc("cold_over"),
            "e2e_p7_vs_lmcache": worst_lmc("e2e_ours_over")}

"""A registry's series as plain data (`snapshot`: what one process ships to another), and the
families several processes' snapshots make together, each sample labelled with the process it
came from (`families`): what vLLM's /metrics exposes of the `loadback_*` series
(engines/vllm/stats.py ships and exposes them; `loadback status` reads them apart by
`PROCESS_LABEL`). No vLLM here, so the main suite builds the same exposition.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.metrics_core import Metric

#: the label naming the process a shipped sample came from: `scheduler`, `rank0`, `rank1`, ...
PROCESS_LABEL = "loadback_process"
#: the family every snapshot carries: when its process took it (Unix time). A process ships
#: only while vLLM runs steps, so on an idle server this says how old its series are.
TAKEN_AT = "loadback_snapshot_timestamp_seconds"

Snapshot = list  # [[family, type, help, [[sample, {label: value}, value], ...]], ...]


def snapshot(registry, families: frozenset[str] | None = None, *,
             taken_at: float | None = None) -> Snapshot:
    """The registry's families now (plain lists: vLLM pickles and msgpacks them), without
    `_created` samples (a process's own timestamps); with `taken_at`, the `TAKEN_AT` family."""
    out = []
    for fam in registry.collect():
        if families is not None and fam.name not in families:
            continue
        samples = [[s.name, dict(s.labels), float(s.value)] for s in fam.samples
                   if not s.name.endswith("_created")]
        out.append([fam.name, fam.type, fam.documentation, samples])
    if taken_at is not None:
        out.append([TAKEN_AT, "gauge", "when this process took the snapshot of its series "
                    "shown here (Unix time)", [[TAKEN_AT, {}, float(taken_at)]]])
    return out


def families(latest: Iterable[tuple[dict[str, str], Snapshot]]) -> list[Metric]:
    """One family per name across the snapshots, each sample with its snapshot's labels added
    (the process's `PROCESS_LABEL`, the engine's labels)."""
    merged: dict[str, Metric] = {}
    for extra, fams in latest:
        for name, typ, doc, samples in fams:
            fam = merged.setdefault(name, Metric(name, doc, typ))
            for sample, labels, value in samples:
                fam.add_sample(sample, {**labels, **extra}, value)
    return list(merged.values())

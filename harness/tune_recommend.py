"""`loadback tune`'s recommendation: from the samples measured at each prefix size, the config
values (deadlines, retries, break-even), each with the measurement it came from, and the YAML
that holds them. No daemon here: harness/tune.py measures.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field

from .bench.common import fmt, median, percentile

TYPICAL_CHUNKS = 16
LOOKUP_PCT, LOOKUP_FACTOR, LOOKUP_MARGIN_MS = 99.0, 2.0, 5.0
RETRIEVE_FACTOR, RETRIEVE_MARGIN_MS = 1.5, 2.0
CAP_TOKENS, CAP_MS = 131072, 30000.0


@dataclass
class Size:
    """One prefix size's samples (milliseconds), as measured."""


    chunks: int
    tokens: int
    lookup_ms: list[float] = field(default_factory=list)
    retrieve_ms: list[float] = field(default_factory=list)
    nbytes: int = 0
    misses: int = 0
    errors: list[str] = field(default_factory=list)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b*x with a, b >= 0 (one point: through the origin)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return 0.0, ys[0] / xs[0]
    b, a = statistics.linear_regression(xs, ys)
    if b < 0:  # slower for fewer tokens is noise: a flat line at the mean
        return statistics.fmean(ys), 0.0
    if a < 0:  # a negative fixed cost is noise: refit through the origin
        return 0.0, statistics.linear_regression(xs, ys, proportional=True).slope
    return a, b


def _up(x: float, digits: int = 1) -> float:
    return math.ceil(x * 10 ** digits) / 10 ** digits


def recommend(sizes: list[Size], chunk: int, prefill_tps: float):
    """[(config key, value, measurement it came from)] from the measured sizes."""
    got = [s for s in sizes if s.retrieve_ms]
    look = max((s for s in sizes if s.lookup_ms), key=lambda s: percentile(s.lookup_ms, LOOKUP_PCT))
    lp99 = percentile(look.lookup_ms, LOOKUP_PCT)
    a99, b99 = fit([(s.tokens / 1024, percentile(s.retrieve_ms, 99)) for s in got])
    # A least-squares line passes below some points: lift its intercept so that the
    # deadline line covers every measured size's p99 before the safety factor.
    cover = max(percentile(s.retrieve_ms, 99) - b99 * s.tokens / 1024 for s in got)
    a50, b50 = fit([(s.tokens / 1024, median(s.retrieve_ms)) for s in got])
    base = _up(max(a99, cover) * RETRIEVE_FACTOR + RETRIEVE_MARGIN_MS)
    per_ki = _up(b99 * RETRIEVE_FACTOR, 3)
    cap = max(base, min(CAP_MS, _up(base + per_ki * CAP_TOKENS / 1024)))
    typ = min(got, key=lambda s: abs(s.chunks - TYPICAL_CHUNKS))
    typ_deadline = min(cap, base + per_ki * typ.tokens / 1024)
    typ_p50 = median(typ.retrieve_ms)
    attempts = max(1, min(4, int(typ_deadline // max(typ_p50, 1e-6))))
    big = max(got, key=lambda s: s.tokens)
    gbps = big.nbytes / (median(big.retrieve_ms) / 1000) / 1e9
    if prefill_tps <= 0:
        min_tok, why = 0, "--prefill-tokens-per-s 0: the time comparison is off"
    else:
        beats = [k * chunk for k in range(1, CAP_TOKENS // chunk + 1)
                 if a50 + b50 * k * chunk / 1024 < 1000 * k * chunk / prefill_tps]
        # When loading never wins, no floor is written: break_even.prefill_tokens_per_s makes
        # the orchestrator skip loads by the bandwidth it measures live, and recovers by
        # itself if the daemon gets faster; a huge floor would switch load-back off for good.
        min_tok = 0 if not beats or beats[0] == chunk else beats[0]
        why = (f"p50 fit {fmt(a50, 3)} + {fmt(b50, 4)} ms/Ki vs prefill "
               f"{1e6 / prefill_tps:.1f} ms/Ki at {prefill_tps:g} tok/s: "
               + ("loading wins from the first chunk" if beats and min_tok == 0 else
                  f"loading wins from {min_tok} tokens" if beats else
                  f"WARNING loading never won up to {CAP_TOKENS} tokens here; no floor is set, "
                  "the live break-even check (bandwidth learned per retrieve) decides; "
                  "check the prefill speed and the daemon's transfer mode (shm is faster)"))
    fits = {"p99": (a99, b99), "p50": (a50, b50)}
    return fits, [
        ("deadlines.lookup_ms", _up(lp99 * LOOKUP_FACTOR + LOOKUP_MARGIN_MS),
         f"p{LOOKUP_PCT:g} lookup {fmt(lp99, 3)} ms (slowest size, {look.tokens} tokens) "
         f"x {LOOKUP_FACTOR:g} + {LOOKUP_MARGIN_MS:g} ms margin"),
        ("deadlines.retrieve_base_ms", base,
         f"p99 fit intercept {fmt(a99, 3)} ms"
         + (f", lifted to {fmt(cover, 3)} ms to cover every size's p99," if cover > a99 else "")
         + f" x {RETRIEVE_FACTOR:g} + {RETRIEVE_MARGIN_MS:g} ms"),
        ("deadlines.retrieve_per_ki_token_ms", per_ki,
         f"p99 fit slope {fmt(b99, 4)} ms/Ki x {RETRIEVE_FACTOR:g}"),
        ("deadlines.retrieve_max_ms", cap,
         f"the deadline for {CAP_TOKENS} tokens, capped at {CAP_MS:g} ms"),
        ("retries.max_attempts", attempts,
         f"{typ.chunks}-chunk prefix: deadline {fmt(typ_deadline, 1)} ms / p50 retrieve "
         f"{fmt(typ_p50, 3)} ms, clamped to 1..4"),
        ("break_even.initial_bandwidth_gbps", float(f"{max(gbps, 1e-3):.3g}"),
         f"{big.nbytes} bytes / p50 retrieve {fmt(median(big.retrieve_ms), 3)} ms "
         f"({big.tokens} tokens)"),
        ("break_even.prefill_tokens_per_s", float(prefill_tps), "--prefill-tokens-per-s"),
        ("break_even.min_tokens", min_tok, why),
    ]


def render_yaml(host: str, port: int, chunk: int, recs, header: list[str]) -> str:
    sections: dict[str, list[str]] = {}
    for key, value, why in recs:
        sec, name = key.split(".")
        sections.setdefault(sec, []).append(f"  {name}: {value!r}  # {why}")
    lines = [f"# {h}" for h in header] + [
        "mode: mp", f"mp_host: {json.dumps(host)}", f"mp_port: {port}", f"chunk_size: {chunk}"]
    for sec, rows in sections.items():
        lines += [f"{sec}:"] + rows
    return "\n".join(lines) + "\n"

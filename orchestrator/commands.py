"""The core's side of the `loadback` verbs that need neither an engine nor the harness:
config validate|show, configs export, diagram, the installed version and the shipped chaos
scenarios' names. The command line itself (argparse) is the CLI's (`lmcache_loadback.cli`);
each function here prints its answer and returns an exit code (`exit_codes`).
"""

from __future__ import annotations

import json
import sys

from .exit_codes import EXIT_INVALID, EXIT_OK, EXIT_UNREADABLE, EXIT_USAGE

DISTRIBUTION = "lmcache-loadback"


def deadlines_line(cfg) -> str:
    """What bounds each call, beside upstream's one 300 s timeout for all of them."""
    d = cfg.deadlines
    cap_tokens = (d.retrieve_max_ms - d.retrieve_base_ms) * 1024 / d.retrieve_per_ki_token_ms \
        if d.retrieve_per_ki_token_ms else 0
    return (f"lookup {d.lookup_ms:g} ms; retrieve {d.retrieve_base_ms:g} ms + "
            f"{d.retrieve_per_ki_token_ms:g} ms per 1024 tokens, capped at {d.retrieve_max_ms:g} ms"
            f" (reached at {cap_tokens:,.0f} tokens); control {d.control_ms:g} ms; store "
            f"{d.store_ms:g} ms; connect {d.connect_ms:g} ms. Upstream bounds each of these by "
            "lmcache.mp.mq_timeout (default 300 s); here a dead daemon costs a request at most "
            "its own deadline, then it recomputes")


#: What an empty value of a key means, where it means more than nothing.
EMPTY_MEANS = {"model_name": " = the engine's model (SGLang --model-path, vLLM --model)"}


def config_command(action: str, file: str, *, as_json: bool = False) -> int:
    """`config validate FILE` (exit 0, 2 invalid, 3 unreadable) or `config show FILE`."""
    from .config import ConfigError, LoadBackConfig

    try:
        if action == "validate":
            cfg, upstream_rows = LoadBackConfig.read(file)
            print(f"{file}: valid")
            for row in upstream_rows:  # how an upstream LMCache file's keys map onto ours
                print(f"  {row.key} = {row.value!r}: {row.note}")
            if upstream_rows:
                print(f"  deadlines in force: {deadlines_line(cfg)}")
            return EXIT_OK
        rows = LoadBackConfig.explain(file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE if exc.unreadable else EXIT_INVALID
    if as_json:
        print(json.dumps({k: {"value": v, "from": src} for k, v, src in rows}, indent=2))
        return EXIT_OK
    width = max(len(k) for k, _, _ in rows)
    for key, value, src in rows:
        if value == "":  # an empty string shown as one, and what it means where it means one
            value = '""' + EMPTY_MEANS.get(key, "")
        print(f"{key:<{width}}  {value!s:<14}  ({src})")
    return EXIT_OK


def export_command(dest: str, *, force: bool = False) -> int:
    """`configs export DIR`: the shipped configs; 64 onto existing files without force."""
    from .resources import export_configs

    try:
        written = export_configs(dest, force=force)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {len(written)} files to {dest} (example configs, chaos/ scenarios, "
          "Grafana dashboard, Prometheus alert rules and scrape config)")
    return EXIT_OK


def diagram_command() -> int:
    """`diagram`: the prefix state machine as mermaid."""
    from .states import mermaid

    print(mermaid())
    return EXIT_OK


def installed_version() -> str:
    """The installed distribution's version (its metadata), not a copy in the source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (no installed lmcache-loadback distribution found)"


def scenario_names() -> list[str]:
    """The shipped chaos scenarios' names, read from configs/chaos/*.yaml (no torch, no
    harness import); empty if the shipped files cannot be found or read."""
    import yaml

    from .resources import configs_dir

    try:
        files = sorted((configs_dir() / "chaos").glob("*.yaml"))
        return [str(yaml.safe_load(f.read_text())["name"]) for f in files]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return []

"""server/ by concern (issue 36): its sub-packages import one way, from the role entry points down to the HTTP API
and the top modules (lifecycle, probes) that break the circle between `afd serve` and the API processes."""

from tests.runtime.test_layering import RUNTIME, import_graph

ORDER = ("serve", "api_process", "front", "api", "")  # "": server's top modules (lifecycle.py, probe_http.py)


def part(module: str) -> str:
    """`afd.server.api.app` → `api`; `afd.server.lifecycle` → ``."""
    name = module.split(".")[2] if module.count(".") >= 2 else ""
    return name if (RUNTIME / "afd" / "server" / name).is_dir() and name else ""


def test_server_sub_packages_import_one_way():
    graph = import_graph(RUNTIME)
    server = {m: targets for m, targets in graph.items() if m.startswith("afd.server.")}
    assert {part(m) for m in server} == set(ORDER)
    upward = [f"{m} (line {line}) imports {t}" for m, targets in server.items() for t, line in targets.items()
              if t.startswith("afd.server.") and ORDER.index(part(t)) < ORDER.index(part(m))]
    assert upward == []

"""Command line of the operator: `python -m afd_operator run|render|crd|rbac`.

`afd operator …` and `afd render …` in the runtime CLI call `operator_main` and
`render_main` with the arguments that follow the subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import yaml

from afd_operator.model.spec import SpecError, parse_owner, parse_spec
from afd_operator.rendering.children import dump_yaml, render_all
from afd_operator.rendering.security import render_group_secret
from afd_operator.reconcile.secret import new_secret_value


def render_file(path: str, namespace: Optional[str] = None) -> str:
    """The manifests the operator would apply for the AFDDeployment(s) in `path` (`-` is stdin),
    with the group Secret the operator would create (a new random value each time)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    objects = []
    for body in yaml.safe_load_all(text):
        if not body:
            continue
        if body.get("kind") != "AFDDeployment":
            raise SpecError(f"{path}: expected kind AFDDeployment, found {body.get('kind')!r}")
        body = dict(body)
        meta = dict(body.get("metadata") or {})
        meta["namespace"] = namespace or meta.get("namespace") or "default"
        meta.setdefault("uid", "00000000-0000-0000-0000-000000000000")  # the API server assigns the real one
        body["metadata"] = meta
        owner = parse_owner(body)
        spec = parse_spec(body.get("spec"))
        if spec.autoscaling.enabled:  # the operator starts from spec.replicas within minGroups..maxGroups
            spec = spec.model_copy(update={"replicas": spec.autoscaling.clamp(spec.replicas)})
        objects += render_all(spec, owner)
        # The operator creates this once per resource; here, a fresh value on every call.
        objects.append(render_group_secret(owner, new_secret_value()))
    return dump_yaml(objects)


def run_operator(namespaces: Sequence[str] = (), peering: Optional[str] = None,
                 liveness: Optional[str] = None, resync_seconds: Optional[float] = None,
                 metrics_port: Optional[int] = None) -> None:
    """Run the operator until interrupted: all namespaces unless some are named; standalone
    unless a peering name is given (then kopf peering elects one active operator); its own
    Prometheus metrics on `metrics_port` when given."""
    import kopf  # kopf, kubernetes, prometheus_client: the operator extra; `render` runs on a base install

    from afd_operator.handlers import OperatorMemo, build_registry  # kopf (see above)
    from afd_operator.metrics import OperatorMetrics, serve_metrics  # prometheus_client (see above)

    metrics = OperatorMetrics()
    if metrics_port is not None:
        serve_metrics(metrics_port, metrics)
    asyncio.run(kopf.operator(
        registry=build_registry(resync_seconds),
        memo=OperatorMemo(metrics=metrics),
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        standalone=peering is None,
        peering_name=peering,
        liveness_endpoint=liveness,
    ))


def operator_main(argv: Optional[Sequence[str]] = None) -> int:
    """`afd operator [--namespace NS]… [--peering NAME] [--liveness URL] [--metrics-port N] [--verbose]`."""
    parser = argparse.ArgumentParser(prog="afd operator", description="Run the AFDDeployment operator.")
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; glob patterns allowed); default: all")
    parser.add_argument("--peering", metavar="NAME",
                        help="coordinate with other operator replicas through kopf peering NAME "
                             "(needs kopf's peering CRDs); default: standalone")
    parser.add_argument("--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--resync-seconds", type=float, help="how often every resource is re-checked (default 10)")
    parser.add_argument("--metrics-port", type=_port, metavar="PORT",
                        help="serve the operator's Prometheus metrics on http://0.0.0.0:PORT/metrics; default: off")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_operator(args.namespace, args.peering, args.liveness, args.resync_seconds, metrics_port=args.metrics_port)
    return 0


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, found {text}")
    return port


def render_main(argv: Optional[Sequence[str]] = None) -> int:
    """`afd render -f cr.yaml [--namespace NS]`: print the manifests, no cluster needed."""
    parser = argparse.ArgumentParser(prog="afd render",
                                     description="Print the manifests the operator would apply for an AFDDeployment.")
    parser.add_argument("-f", "--filename", required=True, help="AFDDeployment YAML file, or - for stdin")
    parser.add_argument("-n", "--namespace", help="namespace to render into (default: the file's, else default)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render_file(args.filename, args.namespace))
    except (SpecError, OSError) as err:
        print(f"afd render: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m afd_operator {run,render,crd,rbac}`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run": operator_main, "render": render_main, "crd": _print_crd, "rbac": _print_rbac}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m afd_operator {run,render,crd,rbac} [--help]\n\n"
              "  run     run the operator (kubeconfig from KUBECONFIG or in-cluster)\n"
              "  render  print the manifests for an AFDDeployment file, without a cluster\n"
              "  crd     print the AFDDeployment CustomResourceDefinition\n"
              "  rbac    print the operator's ClusterRole", file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


def crd_path() -> Path:
    """The canonical CRD file (crds/ at the repository root)."""
    return Path(__file__).resolve().parents[2] / "crds" / "afd.io_afddeployments.yaml"


def _print_crd(argv: Sequence[str]) -> int:
    sys.stdout.write(crd_path().read_text())
    return 0


def _print_rbac(argv: Sequence[str]) -> int:
    sys.stdout.write(resources.files("afd_operator").joinpath("rbac.yaml").read_text())
    return 0

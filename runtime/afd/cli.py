"""The `afd` command line: generate, serve, up, route, plan, make-tiny-model (and internal run-batch)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from afd.config import (
    KV_CACHE_DTYPES, SECTIONS, SETTINGS, AFDConfig, ConfigError, load_config, local_config, process_setting,
    values_from_topology,
)
from afd.connector.base import ConnectorError
from afd.local.children import ChildFailed
from afd.local.log_folders import KEEP
from afd.models.spec import UnsupportedModelError, parse_spec
from afd.planner.command import add_parser as add_plan_parser
from afd.planner.command import cmd_plan
from afd.checkpoint_tools.tiny import ARCHES, FP8_ARCHES, make_tiny_model
from afd.config.topology import TopologyError
from afd.vllm_plugin import serve as vllm_serve

# Imported where used instead: whatever needs torch, msgpack or fastapi (the operator image runs `afd operator`
# through this module with none of them), and the operator package itself.

log = logging.getLogger("afd")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other failure of this CLI."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def _user_errors() -> tuple[type[BaseException], ...]:
    from afd.connector.wire import ProtocolError  # local import: msgpack: not in the operator image
    from afd.models.checkpoint import CheckpointError  # local import: torch

    return (ConfigError, TopologyError, CheckpointError, UnsupportedModelError, ConnectorError, ProtocolError,
            ChildFailed, RuntimeError)


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least one non-negative token id")
    return ids


# the defaults of the group flags of `afd generate` and `afd up` (lowest of their sources)
GENERATE_DEFAULTS = {"topology": "1A1F", "stages": 1, "gate": "ffn", "dtype": "float32", "device": "cpu"}
UP_DEFAULTS = {"topology": "2A1F", "stages": 2, "gate": "ffn"}
LOCAL_SETTINGS_EPILOG = (
    "Settings as for `afd serve` (docs/configuration.md), later ones winning: these defaults < --config FILE "
    "(or AFD_CONFIG_FILE) < AFD_* variables < flags; every rank gets them. {own} "
    "are afd {command}'s own: a file, variable or flag setting one is refused.")
UP_LOGS_EPILOG = ("Each run logs every rank into its own $TMPDIR/afd-local-* folder (default /tmp; printed at start); "
                  "the newest {keep} folders of finished runs are kept, older ones are removed.")


def _add_group_flags(parser: argparse.ArgumentParser, defaults: dict, model_default: str) -> None:
    """The flags `afd generate` and `afd up` share, each naming its default and its variable."""
    parser.add_argument("--model", help=f"Hugging Face checkpoint folder (default: {model_default}; AFD_MODEL)")
    parser.add_argument("--config", metavar="FILE", help="YAML/JSON settings file, as for `afd serve` (AFD_CONFIG_FILE)")
    parser.add_argument("--topology", help=f"attention and FFN ranks, e.g. 4A2F: A attention ranks, F FFN ranks, A >= F "
                                           f"(default {defaults['topology']}; AFD_TOPOLOGY)")
    parser.add_argument("--stages", type=int, help="micro-batches per layer: 1, or 2 to overlap attention with the FFN "
                                                   f"(ping-pong) (default {defaults['stages']}; AFD_STAGES)")
    parser.add_argument("--gate", choices=("ffn", "attention"), help="where the MoE router runs "
                        f"(default {defaults['gate']}; AFD_GATE_ON_ATTENTION=true: attention)")
    parser.add_argument("--ffn-expert-parallel", type=int, metavar="G",
                        help="shards per FFN rank, each holding 1/G of the routed experts (default 1; AFD_FFN_EXPERT_PARALLEL)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="KV cache element type: auto (the model's dtype) or fp8 (e4m3, half the bytes a token) "
                             "(default auto; AFD_KV_CACHE_DTYPE)")


def _group_config(args: argparse.Namespace, command: str, defaults: dict, **flags):
    """The config of `afd generate` / `afd up` from their flags, built as `afd serve` builds its own."""
    defaults = dict(defaults)
    flags.update(model=args.model, stages=args.stages, ffn_expert_parallel=args.ffn_expert_parallel,
                 kv_cache_dtype=args.kv_cache_dtype,
                 gate_on_attention=None if args.gate is None else args.gate == "attention")
    if args.topology is not None:
        flags.update(values_from_topology(args.topology, "--topology"))
    start = {**values_from_topology(defaults.pop("topology")), "gate_on_attention": defaults.pop("gate") == "attention",
             **defaults}
    return local_config(command, flags, start, monolithic=args.monolithic, file=args.config)


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (`afd.config.SETTINGS`), grouped by section: its help, variable, default and roles."""
    for section, title in SECTIONS.items():
        group = parser.add_argument_group(f"{title} (flag > AFD_* variable > settings file)")
        for spec in SETTINGS.values():
            if spec.section != section or not spec.flag:
                continue
            default = str(spec.default).lower() if spec.type is bool else spec.default if spec.default != "" else "empty"
            allowed = f"{spec.allowed}; " if spec.allowed else ""
            text = f"{spec.help} ({allowed}default {default}; {spec.env}; read by {', '.join(spec.roles)})"
            metavar = "|".join(map(str, spec.choices)) or spec.type.__name__.upper()
            group.add_argument(spec.flag_name, dest=spec.name, metavar=metavar, help=text.replace("%", "%%"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="afd", description="Attention-FFN disaggregated MoE serving.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser("generate", help="greedy-decode token-id prompts on a local AFD deployment",
                                    epilog=LOCAL_SETTINGS_EPILOG.format(command="generate", own="Roles, ranks, ports and hosts"))
    _add_group_flags(generate, GENERATE_DEFAULTS, model_default="none, one is needed")
    generate.add_argument("--connector", help="zmq (one process per rank) or loopback (threads) (default zmq; AFD_CONNECTOR)")
    generate.add_argument("--prompt-ids", type=_prompt_ids, action="append", required=True, metavar="IDS",
                          help="one prompt as comma-separated token ids; repeat for more prompts")
    generate.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    generate.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    generate.add_argument("--dtype", help="float32, bfloat16, float16 or auto (default float32; AFD_DTYPE)")
    generate.add_argument("--device", help="cpu, cuda or auto (default cpu; AFD_DEVICE)")
    generate.add_argument("--ffn-model", help="checkpoint of the FFN ranks (default: --model)")
    generate.add_argument("--monolithic", action="store_true", help="the whole model in this process, no FFN rank (the A/B baseline)")
    generate.add_argument("--json", action="store_true", help="print one JSON line")
    generate.add_argument("--with-logits", action="store_true", help="add each prompt's last-step logits to the JSON")

    serve = commands.add_parser("serve", help="run one role process; configuration from AFD_* env (docs/configuration.md)",
                                description="Run one role process. Every setting: a flag, an AFD_* variable or a key "
                                            "of the --config file (docs/configuration.md).")
    serve.add_argument("--config", help="YAML/JSON settings file (overridden by env, then flags; AFD_CONFIG_FILE)")
    serve.add_argument("--topology", help="attention and FFN ranks, e.g. 4A2F (AFD_TOPOLOGY; sets "
                                          "num_attention_ranks and num_ffn_ranks)")
    _add_setting_flags(serve)

    tiny = commands.add_parser("make-tiny-model", help="write a small random MoE checkpoint with a tokenizer")
    tiny.add_argument("--arch", required=True, help="deepseek_v2, deepseek_v3, deepseek_v32, qwen3_moe or glm4_moe")
    tiny.add_argument("--fp8", action="store_true",
                      help="FP8 block-quantized weights (128x128 blocks, weight_scale_inv) as the published FP8 "
                           "checkpoints: deepseek_v3, deepseek_v32, qwen3_moe or glm4_moe")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="overwrite a non-empty --out folder")

    up = commands.add_parser("up", help="run a supervised local AFD deployment behind one OpenAI URL",
                             epilog=LOCAL_SETTINGS_EPILOG.format(command="up", own="Roles, ranks, ports, hosts and the connector") + " " + UP_LOGS_EPILOG.format(keep=KEEP))
    _add_group_flags(up, UP_DEFAULTS, model_default="a tiny qwen3_moe with random weights, made and cached on first use")
    up.add_argument("--port", type=int, default=8000, help="port of the OpenAI-compatible URL (default 8000)")
    up.add_argument("--monolithic", action="store_true",
                    help="one process with the whole model (FFN local), same engine and API: the A/B baseline")
    up.add_argument("--state-file", help="JSON file describing the API URL and every rank, kept current")
    up.add_argument("--no-demo", action="store_true", help="do not send the demo request once ready")
    up.add_argument("--max-request-bytes", type=int, help="larger request bodies get 413 (default 16 MiB; AFD_MAX_REQUEST_BYTES)")
    up.add_argument("--max-prompts", type=int, help="prompts per /v1/completions request (default 128; AFD_MAX_PROMPTS)")
    up.add_argument("--max-prompt-chars", type=int,
                    help="characters of a prompt before tokenization (default 32 per context token; AFD_MAX_PROMPT_CHARS)")
    up.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="keep prompts' prefixes in the KV cache for later requests (default on; AFD_PREFIX_CACHING)")
    up.add_argument("--read-timeout", type=float, default=600.0,
                    help="seconds the front door waits for a rank to send something (default 600)")

    route = commands.add_parser(
        "route", help="the front door of `afd up` on its own: one OpenAI URL over ranks found by DNS (a Kubernetes "
        "Deployment, spec.router)",
        epilog="Listens on AFD_HTTP_PORT (API) and AFD_METRICS_PORT (/health, /live, /drain, /metrics); checks "
        "AFD_API_KEY as the ranks do; signs moved streams with AFD_GROUP_SECRET (the ranks' group secret: without it "
        "streams do not move); in-flight relays get AFD_SHUTDOWN_GRACE_S after SIGTERM.")
    route.add_argument("--ranks", help="attention ranks, comma-separated DNS names (each address a rank) or "
                       "http://host:port URLs (AFD_ROUTE_RANKS)")
    route.add_argument("--port", type=int, help="API port (default 8000; AFD_HTTP_PORT)")
    route.add_argument("--metrics-port", type=int, help="probe and metrics port (default 9090; AFD_METRICS_PORT)")
    route.add_argument("--read-timeout", type=float, default=600.0,
                       help="seconds the front door waits for a rank to send something (default 600)")

    add_plan_parser(commands)

    # listed for --help only: main() hands `operator` and `render` to afd_operator's own parsers
    commands.add_parser("operator", help="run the kopf operator (see 'afd operator --help')", add_help=False)
    commands.add_parser("render", help="render an AFDDeployment to manifests offline", add_help=False)

    batch = commands.add_parser("run-batch", help=argparse.SUPPRESS)
    batch.add_argument("--input", required=True)
    batch.add_argument("--output", required=True)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from afd.models.checkpoint import Checkpoint  # local import: torch

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: must be at least 1")
    config = _group_config(args, "generate", GENERATE_DEFAULTS, connector=args.connector, dtype=args.dtype,
                           device=args.device)
    model, connector = config.load.model, config.link.connector
    if not model:
        raise ConfigError("no model: pass --model or set AFD_MODEL")
    if config.load.attention_engine != "afd":
        raise ConfigError(f"attention_engine={config.load.attention_engine} (AFD_ATTENTION_ENGINE): afd generate runs "
                          "afd's own engine (vLLM attention serves through `afd serve` or `afd up`)")
    if connector == "nccl":
        raise ConfigError("connector=nccl (--connector or AFD_CONNECTOR): afd generate runs zmq or loopback groups")
    for path in {model, args.ffn_model or model}:
        spec = parse_spec(Checkpoint(path).config)
        bad = [i for prompt in args.prompt_ids for i in prompt if i >= spec.vocab_size]
        if bad:
            raise ConfigError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary of {path} (size {spec.vocab_size})")
    if args.monolithic:
        from afd.roles.monolithic import generate_monolithic  # local import: torch

        result = generate_monolithic(config, args.prompt_ids, args.max_tokens, args.ignore_eos)
        tokens, logits = result.tokens, [row.tolist() for row in result.last_logits]
    elif connector == "loopback":
        from afd.local.group_threads import generate_in_threads  # local import: torch

        result = generate_in_threads(config, args.prompt_ids, args.max_tokens, args.ignore_eos)
        tokens, logits = result.tokens, [row.tolist() for row in result.last_logits]
    else:
        from afd.local.group_processes import generate_in_processes  # local import: torch

        ffn_model = str(Path(args.ffn_model).resolve()) if args.ffn_model else None
        tokens, logits = generate_in_processes(config, args.prompt_ids, args.max_tokens, args.ignore_eos, ffn_model)
    output: dict = {"outputs": tokens}
    if args.with_logits:
        output["last_logits"] = logits
    print(json.dumps(output) if args.json else "\n".join(" ".join(map(str, row)) for row in tokens))
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    from afd.local.offline_batch import batch_cache_tokens, run_attention_batch  # local import: torch
    from afd.roles.attention import build_attention  # local import: torch

    job = json.loads(Path(args.input).read_text())
    role = build_attention(load_config(), batch_cache_tokens(job["prompts"], job["max_tokens"]))
    result = run_attention_batch(role, job["prompts"], job["max_tokens"], job["ignore_eos"])
    output = {"tokens": result.tokens, "last_logits": [row.tolist() for row in result.last_logits]}
    Path(args.output).write_text(json.dumps(output))
    return 0


def serve_config(args: argparse.Namespace) -> AFDConfig:
    """`afd serve`'s config: its flags (one per setting) over `AFD_*` over the --config file."""
    cli = {name: getattr(args, name) for name, spec in SETTINGS.items() if spec.flag}
    if args.topology:
        cli.update(values_from_topology(args.topology, "--topology"))
    return load_config(cli=cli, file=args.config)


def cmd_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    if not config.load.model:
        raise ConfigError("no model: set AFD_MODEL or pass --model")
    if config.group.role == "attention" and config.load.attention_engine == "vllm":
        # this process becomes vLLM's OpenAI server (afd.vllm_plugin)
        return vllm_serve.exec_vllm_server(config.group, config.load, config.api, config.scheduler,
                                           kv_cache_dtype=config.kv.kv_cache_dtype)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if interval := process_setting("AFD_SWITCH_INTERVAL_S"):  # experiment: how often Python hands the GIL on
        sys.setswitchinterval(interval)
    if config.group.role == "ffn":
        from afd.roles.ffn import serve_ffn  # local import: torch

        return serve_ffn(config, stop)
    if config.group.role == "monolithic":
        from afd.roles.monolithic import serve_monolithic  # local import: torch, fastapi

        return serve_monolithic(config, stop)
    from afd.roles.attention import serve_attention  # local import: torch, fastapi

    return serve_attention(config, stop)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    if args.arch not in ARCHES:
        raise ConfigError(f"--arch {args.arch!r}: must be one of {', '.join(ARCHES)}")
    if args.fp8 and args.arch not in FP8_ARCHES:
        raise ConfigError(f"--fp8: FP8 checkpoints are made for {', '.join(FP8_ARCHES)}, not {args.arch!r}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"--out {out}: folder is not empty (pass --force to overwrite)")
    make_tiny_model(args.arch, out, args.seed, fp8=args.fp8)
    print(out)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from afd.models.checkpoint import Checkpoint  # local import: torch
    from afd.server.front.door import FrontSettings  # local import: fastapi
    from afd.local.up import ensure_tiny_model, run_up  # local import: torch

    config = _group_config(args, "up", UP_DEFAULTS, max_request_bytes=args.max_request_bytes,
                           max_prompts=args.max_prompts, max_prompt_chars=args.max_prompt_chars,
                           prefix_caching=args.prefix_caching)
    if not config.load.model:
        config = config.replace(model=str(ensure_tiny_model()))
    Checkpoint(config.load.model)  # a clear error now rather than in every rank's log
    if args.read_timeout <= 0:
        raise ConfigError(f"--read-timeout {args.read_timeout}: must be positive")
    front = FrontSettings(max_request_bytes=config.api.max_request_bytes, read_timeout_s=args.read_timeout)
    return run_up(config, args.port, Path(args.state_file) if args.state_file else None, demo=not args.no_demo, front=front)


def cmd_route(args: argparse.Namespace) -> int:
    from afd.server.front.door import FrontSettings  # local import: fastapi
    from afd.server.front.route import RouteSettings, run_route  # local import: fastapi, uvicorn
    from afd.server.api.api_keys import ApiKeys  # local import: fastapi

    config = load_config()
    ranks = tuple(r.strip() for r in (args.ranks or process_setting("AFD_ROUTE_RANKS")).split(",") if r.strip())
    if not ranks:
        raise ConfigError("afd route needs the attention ranks: --ranks or AFD_ROUTE_RANKS (DNS names or URLs)")
    if args.read_timeout <= 0:
        raise ConfigError(f"--read-timeout {args.read_timeout}: must be positive")
    front = FrontSettings(max_request_bytes=config.api.max_request_bytes, read_timeout_s=args.read_timeout,
                          shutdown_grace_s=config.process.shutdown_grace_s,
                          resume_key=config.group.group_secret.encode(), api_keys=ApiKeys(config.api.api_keys))
    return run_route(RouteSettings(
        ranks, host=config.api.http_host, port=args.port or config.api.http_port,
        metrics_port=args.metrics_port or config.process.metrics_port,
        rank_http_port=process_setting("AFD_ROUTE_RANK_HTTP_PORT"),
        rank_metrics_port=process_setting("AFD_ROUTE_RANK_METRICS_PORT"),
        refresh_s=process_setting("AFD_ROUTE_REFRESH_S"), front=front))


COMMANDS = {
    "up": cmd_up,
    "route": cmd_route,
    "plan": cmd_plan,
    "generate": cmd_generate,
    "serve": cmd_serve,
    "make-tiny-model": cmd_make_tiny_model,
    "run-batch": cmd_run_batch,
}


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("operator", "render"):  # their own parsers take every flag that follows
        from afd_operator.cli import operator_main, render_main  # local import: the operator package, not in every install

        return (operator_main if argv[0] == "operator" else render_main)(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=process_setting("AFD_LOG_LEVEL") or ("INFO" if args.command in ("serve", "run-batch", "route") else "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    if args.command in ("generate", "up"):
        signal.signal(signal.SIGTERM, _raise_interrupt)  # clean up children on `kill` as on Ctrl-C
    try:
        return COMMANDS[args.command](args)
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

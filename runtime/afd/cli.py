"""The `afd` command line: generate, serve, up, plan, make-tiny-model (and internal run-batch)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from afd.config import ConfigError, load_config
from afd.topology import TopologyError

log = logging.getLogger("afd")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other failure of this CLI."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def _user_errors() -> tuple[type[BaseException], ...]:
    from afd.connector.base import ConnectorError
    from afd.connector.wire import ProtocolError
    from afd.models.checkpoint import CheckpointError
    from afd.models.spec import UnsupportedModelError
    from afd.local.children import ChildFailed

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="afd", description="Attention-FFN disaggregated MoE serving.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser("generate", help="greedy-decode token-id prompts on a local AFD deployment")
    generate.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    generate.add_argument("--topology", default="1A1F", help="e.g. 2A1F: attention ranks A, FFN ranks F (A >= F)")
    generate.add_argument("--stages", type=int, default=1, help="micro-batches per layer: 1, or 2 (ping-pong)")
    generate.add_argument("--gate", default="ffn", help="where the MoE router runs: ffn or attention")
    generate.add_argument("--connector", default="zmq", help="zmq (one process per rank) or loopback (threads)")
    generate.add_argument("--ffn-expert-parallel", type=int, default=1, metavar="G",
                          help="shards per FFN rank, each holding 1/G of the routed experts")
    generate.add_argument("--prompt-ids", type=_prompt_ids, action="append", required=True, metavar="IDS")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    generate.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    generate.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    generate.add_argument("--ffn-model", help="checkpoint of the FFN ranks (default: --model)")
    generate.add_argument("--monolithic", action="store_true", help="the whole model in this process, no FFN rank (the A/B baseline)")
    generate.add_argument("--json", action="store_true", help="print one JSON line")
    generate.add_argument("--with-logits", action="store_true", help="add each prompt's last-step logits to the JSON")

    serve = commands.add_parser("serve", help="run one role process; configuration from AFD_* env (docs/configuration.md)")
    serve.add_argument("--config", help="YAML/JSON settings file (overridden by env, then flags)")
    serve.add_argument("--role")
    serve.add_argument("--rank", type=int)
    serve.add_argument("--model")
    serve.add_argument("--topology")
    serve.add_argument("--connector")
    serve.add_argument("--stages", type=int)

    tiny = commands.add_parser("make-tiny-model", help="write a small random MoE checkpoint with a tokenizer")
    tiny.add_argument("--arch", required=True, help="deepseek_v2 or qwen3_moe")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="overwrite a non-empty --out folder")

    up = commands.add_parser("up", help="run a supervised local AFD deployment behind one OpenAI URL")
    up.add_argument("--model", help="checkpoint folder (default: a tiny qwen3_moe made and cached on first use)")
    up.add_argument("--topology", default="2A1F")
    up.add_argument("--stages", type=int, default=2)
    up.add_argument("--gate", default="ffn", help="ffn or attention")
    up.add_argument("--ffn-expert-parallel", type=int, default=1, metavar="G",
                    help="shards per FFN rank, each holding 1/G of the routed experts")
    up.add_argument("--port", type=int, default=8000, help="port of the OpenAI-compatible URL")
    up.add_argument("--monolithic", action="store_true",
                    help="one process with the whole model (FFN local), same engine and API: the A/B baseline")
    up.add_argument("--state-file", help="JSON file describing the API URL and every rank, kept current")
    up.add_argument("--no-demo", action="store_true", help="do not send the demo request once ready")
    up.add_argument("--max-request-bytes", type=int, help="larger request bodies get 413 (default 16 MiB; AFD_MAX_REQUEST_BYTES)")
    up.add_argument("--max-prompts", type=int, help="prompts per /v1/completions request (default 128; AFD_MAX_PROMPTS)")
    up.add_argument("--max-prompt-chars", type=int,
                    help="characters of a prompt before tokenization (default 32 per context token; AFD_MAX_PROMPT_CHARS)")
    up.add_argument("--read-timeout", type=float, default=600.0,
                    help="seconds the front door waits for a rank to send something (default 600)")

    from afd.planner.command import add_parser as add_plan_parser

    add_plan_parser(commands)

    # listed for --help only: main() hands `operator` and `render` to afd_operator's own parsers
    commands.add_parser("operator", help="run the kopf operator (see 'afd operator --help')", add_help=False)
    commands.add_parser("render", help="render an AFDDeployment to manifests offline", add_help=False)

    batch = commands.add_parser("run-batch", help=argparse.SUPPRESS)
    batch.add_argument("--input", required=True)
    batch.add_argument("--output", required=True)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from afd.config import AFDConfig, values_from_env, values_from_topology
    from afd.models.checkpoint import Checkpoint
    from afd.models.spec import parse_spec

    if args.gate not in ("ffn", "attention"):
        raise ConfigError(f"--gate {args.gate!r}: must be ffn or attention")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: must be at least 1")
    config = AFDConfig(
        role="attention",
        **values_from_topology(args.topology, "--topology"),
        connector=args.connector,
        stages=args.stages,
        gate_on_attention=args.gate == "attention",
        model=str(Path(args.model).resolve()),
        dtype=args.dtype,
        device=args.device,
        ffn_address_template="127.0.0.1",
        port_stride=2,  # local ranks share one host; each FFN process gets its own ports
        ffn_expert_parallel=args.ffn_expert_parallel,
        # the link's patience, as `afd serve` takes it (a slow machine is not a lost peer)
        **{k: v for k, v in values_from_env(os.environ).items() if k in ("peer_timeout_s", "connect_timeout_s")},
    )
    if config.connector == "nccl":
        raise ConfigError("--connector nccl: afd generate runs zmq or loopback groups")
    for path in {args.model, args.ffn_model or args.model}:
        spec = parse_spec(Checkpoint(path).config)
        bad = [i for prompt in args.prompt_ids for i in prompt if i >= spec.vocab_size]
        if bad:
            raise ConfigError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary of {path} (size {spec.vocab_size})")
    if args.monolithic:
        from afd.monolithic import generate_monolithic

        result = generate_monolithic(config.replace(role="monolithic", num_attention_ranks=1, num_ffn_ranks=1),
                                     args.prompt_ids, args.max_tokens, args.ignore_eos)
        tokens, logits = result.tokens, [row.tolist() for row in result.last_logits]
    elif config.connector == "loopback":
        from afd.local.group_threads import generate_in_threads

        result = generate_in_threads(config, args.prompt_ids, args.max_tokens, args.ignore_eos)
        tokens, logits = result.tokens, [row.tolist() for row in result.last_logits]
    else:
        from afd.local.group_processes import generate_in_processes

        ffn_model = str(Path(args.ffn_model).resolve()) if args.ffn_model else None
        tokens, logits = generate_in_processes(config, args.prompt_ids, args.max_tokens, args.ignore_eos, ffn_model)
    output: dict = {"outputs": tokens}
    if args.with_logits:
        output["last_logits"] = logits
    print(json.dumps(output) if args.json else "\n".join(" ".join(map(str, row)) for row in tokens))
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    from afd.local.offline_batch import run_attention_batch

    job = json.loads(Path(args.input).read_text())
    config = load_config()
    result = run_attention_batch(config, job["prompts"], job["max_tokens"], job["ignore_eos"])
    output = {"tokens": result.tokens, "last_logits": [row.tolist() for row in result.last_logits]}
    Path(args.output).write_text(json.dumps(output))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from afd.config import values_from_topology

    cli = {"role": args.role, "rank": args.rank, "model": args.model, "connector": args.connector, "stages": args.stages}
    if args.topology:
        cli.update(values_from_topology(args.topology, "--topology"))
    config = load_config(cli=cli, file=args.config)
    if not config.model:
        raise ConfigError("no model: set AFD_MODEL or pass --model")
    if config.role == "attention" and config.attention_engine == "vllm":
        from afd.vllm_plugin.serve import exec_vllm_server

        return exec_vllm_server(config)  # this process becomes vLLM's OpenAI server (afd.vllm_plugin)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if os.environ.get("AFD_SWITCH_INTERVAL_S"):  # experiment: how often Python hands the GIL between threads
        sys.setswitchinterval(float(os.environ["AFD_SWITCH_INTERVAL_S"]))
    if config.role == "ffn":
        from afd.server.ffn_run import serve_ffn

        return serve_ffn(config, stop)
    from afd.server.run import serve_attention

    return serve_attention(config, stop)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from afd.tiny import ARCHES, make_tiny_model

    if args.arch not in ARCHES:
        raise ConfigError(f"--arch {args.arch!r}: must be one of {', '.join(ARCHES)}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"--out {out}: folder is not empty (pass --force to overwrite)")
    make_tiny_model(args.arch, out, args.seed)
    print(out)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from afd.config import AFDConfig, values_from_env, values_from_topology
    from afd.models.checkpoint import Checkpoint
    from afd.server.front import FrontSettings
    from afd.up import ensure_tiny_model, run_up

    if args.gate not in ("ffn", "attention"):
        raise ConfigError(f"--gate {args.gate!r}: must be ffn or attention")
    model = Path(args.model).resolve() if args.model else ensure_tiny_model()
    Checkpoint(model)  # a clear error now rather than in every rank's log
    flags = {"max_request_bytes": args.max_request_bytes, "max_prompts": args.max_prompts,
             "max_prompt_chars": args.max_prompt_chars}
    # AFD_MAX_*, AFD_API_PROCESS and AFD_API_SERVERS as for `afd serve`
    limits = {k: v for k, v in values_from_env(os.environ).items() if k in flags or k in ("api_process", "api_servers")}
    limits.update({k: v for k, v in flags.items() if v is not None})
    config = AFDConfig(
        **values_from_topology("1A1F" if args.monolithic else args.topology, "--topology"),
        **limits,
        role="monolithic" if args.monolithic else "attention",
        stages=args.stages,
        gate_on_attention=args.gate == "attention",
        model=str(model),
        ffn_address_template="127.0.0.1",
        port_stride=2,
        ffn_expert_parallel=1 if args.monolithic else args.ffn_expert_parallel,
    )
    if args.read_timeout <= 0:
        raise ConfigError(f"--read-timeout {args.read_timeout}: must be positive")
    front = FrontSettings(max_request_bytes=config.max_request_bytes, read_timeout_s=args.read_timeout)
    return run_up(config, args.port, Path(args.state_file) if args.state_file else None, demo=not args.no_demo, front=front)


def cmd_plan(args: argparse.Namespace) -> int:
    from afd.planner.command import cmd_plan as run

    return run(args)


COMMANDS = {
    "up": cmd_up,
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
        from afd_operator.cli import operator_main, render_main

        return (operator_main if argv[0] == "operator" else render_main)(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("AFD_LOG_LEVEL", "INFO" if args.command in ("serve", "run-batch") else "WARNING"),
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

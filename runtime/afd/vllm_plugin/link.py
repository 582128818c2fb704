"""One attention process's link to its FFN rank, shaped for an engine that owns the forward pass.

vLLM calls the model once per step and each crossing layer once per call, in order, so
the step boundary is the first crossing layer: there the link sends the step plan. Every
exchange then ships the layer's rows stage by stage and waits for the FFN's answer.

vLLM runs attention over the whole batch, so two stages split only the FFN exchange (the
FFN computes stage 0 while stage 1 is still arriving); attention does not overlap with the
FFN as it does in our own runner's ping-pong. Stages split as everywhere (`afd.step.stages`,
`dboMinTokens` included). No vLLM import here: this is plain torch over our
`AttentionLink`, tested against our FFN ranks without vLLM installed.

Between steps a daemon thread tends the link with the engine's own keeper
(`afd.engine.recovery.link_care.LinkCare`): heartbeats, leaving a draining FFN rank once this rank has
run no step for `IDLE_AFTER_S` (vLLM steps back to back while any request runs), and once lost
re-handshakes (fresh sockets) until it is back: a loss while idle heals without vLLM noticing,
and a rolling FFN restart ends its drain without waiting out the fallback. A step
while the FFN rank is lost raises `PeerLost` at once rather than waiting out the timeout;
vLLM treats any model error as fatal (EngineDeadError: HTTP 500, /health 503, the server
exits), so Kubernetes restarts the pod, which re-handshakes.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from afd.config import AFDConfig, load_config
from afd.connector import wire
from afd.connector.attention_link import AttentionLink, LinkOptions
from afd.connector.base import AttnTransfer, PeerLost
from afd.connector.tensors import DTYPE_NAMES
from afd.engine.recovery.link_care import LinkCare
from afd.models.checkpoint import Checkpoint
from afd.models.spec import ModelSpec, parse_spec
from afd.runners.handshake import make_hello
from afd.step.stages import StagePolicy
from afd.config.topology import crossing_layers

log = logging.getLogger(__name__)
RECONNECT_TIMEOUT_S = 2.0
IDLE_AFTER_S = 2.0  # no step for this long: vLLM runs no request, so this rank may leave a draining FFN


@dataclass(frozen=True)
class LinkPlan:
    """What the attention side of one checkpoint sends where; pure facts, no sockets."""

    spec: ModelSpec
    crossing: tuple[int, ...]
    gate_on_attention: bool
    policy: StagePolicy  # rows per stage: `policy.rows` (the FFN computes per row, any cut is exact)


class StepLink:
    """Attention rank `config.rank`'s link to its FFN rank, one vLLM step (model call) at a time."""

    def __init__(self, config: AFDConfig, plan: LinkPlan, link: AttentionLink):
        self.config = config
        self.plan = plan
        self.link = link
        self.first_layer = plan.crossing[0] if plan.crossing else -1
        self.step_id = 0
        self._stage_rows: tuple[int, ...] = ()
        self.closed = False
        self.care = LinkCare(link, max(0.05, config.heartbeat_interval_s / 2))
        self._last_step_at = time.monotonic()
        self._lock = threading.Lock()  # the link's sockets belong to one thread at a time

    @property
    def lost(self) -> str | None:
        """Why the FFN rank is unreachable (lost, or left while draining), until a re-handshake succeeds."""
        return self.care.error

    @classmethod
    def connect(cls, model_path: str, dtype: torch.dtype, config: AFDConfig | None = None) -> "StepLink":
        """Read the checkpoint's facts, connect and handshake (raises `HandshakeError`)."""
        config = config or load_config(cli={"role": "attention"})
        if config.role != "attention":
            raise ValueError(f"AFD_ROLE={config.role}: the vLLM plugin runs attention ranks only")
        if config.ffn_expert_parallel > 1:  # it links to one FFN process: shard 0 alone would return a partial sum
            raise ValueError(f"AFD_FFN_EXPERT_PARALLEL={config.ffn_expert_parallel}: the vLLM plugin links to "
                             "unsharded FFN ranks only; use attentionEngine=afd with expert parallelism")
        if not Path(model_path).is_dir():
            raise ValueError(f"model {model_path!r}: the AFD vLLM plugin needs a local checkpoint folder "
                             "(the FFN ranks fingerprint the same files); download it first")
        checkpoint = Checkpoint(model_path)
        spec = parse_spec(checkpoint.config)
        plan = LinkPlan(spec, crossing_layers(spec.moe_layers, config.gate_on_attention), config.gate_on_attention,
                        StagePolicy.of(config))
        hello = make_hello(config, spec, plan.crossing, checkpoint.fingerprint(), DTYPE_NAMES[dtype])
        options = LinkOptions.of(config, reconnect_timeout_s=min(config.connect_timeout_s, RECONNECT_TIMEOUT_S))
        link = AttentionLink.connect(config, hello, "cpu", options)
        log.info("afd: attention rank %d linked to ffn rank %d (%s, layers %s, %d stage(s), gate on %s)",
                 config.rank, link.ffn_rank, config.topology, list(plan.crossing), plan.policy.stages,
                 "attention" if plan.gate_on_attention else "ffn")
        step_link = cls(config, plan, link)
        atexit.register(step_link.close)
        threading.Thread(target=step_link._keepalive_loop, name="afd-ffn-keepalive", daemon=True).start()
        return step_link

    def exchange(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """FFN output [tokens, hidden] of crossing layer `layer` for `hidden` [tokens, hidden]."""
        with self._lock:
            if self.lost:
                raise PeerLost(f"ffn rank {self.link.ffn_rank} is unreachable: {self.lost}")
            try:
                return self._exchange(layer, hidden, router_logits)
            except PeerLost as err:
                self.care.lose(err)
                raise
            finally:
                self._last_step_at = time.monotonic()

    def _exchange(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        if layer == self.first_layer:
            self.step_id += 1
            self._stage_rows = self.plan.policy.rows(hidden.shape[0])
            self.link.send_plan(wire.StepPlan(self.step_id, self._stage_rows))
        elif hidden.shape[0] != sum(self._stage_rows):
            raise RuntimeError(f"layer {layer}: {hidden.shape[0]} rows, but step {self.step_id} planned "
                               f"{sum(self._stage_rows)} (layers must cross in order, starting at {self.first_layer})")
        transfers, start = [], 0
        for stage, rows in enumerate(self._stage_rows):
            if rows:
                transfer = AttnTransfer(self.step_id, layer, stage)
                part = slice(start, start + rows)
                self.link.send(hidden[part], transfer, None if router_logits is None else router_logits[part])
                transfers.append(transfer)
            start += rows
        outputs = [self.link.recv(t).to(device=hidden.device, dtype=hidden.dtype) for t in transfers]
        if len(outputs) == 1:
            return outputs[0]
        return torch.cat(outputs) if outputs else torch.empty_like(hidden)

    def _keepalive_loop(self) -> None:
        while not self.closed:
            time.sleep(self.care.check_s)
            with self._lock:  # between steps (or between a step's layers: then not idle)
                if self.closed:
                    return
                if self.care.due():
                    self.care.tend(self._idle)

    def _idle(self) -> bool:
        """No step for `IDLE_AFTER_S`: vLLM runs steps back to back while it has any request."""
        return time.monotonic() - self._last_step_at >= IDLE_AFTER_S

    def close(self, reason: str = "vllm attention shutting down") -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.link.close(reason)
            except Exception as err:  # at exit the peer may be gone already
                log.debug("afd: closing the ffn link: %s", err)

"""Issue 35.1 on a GPU: an NCCL pair set up on a helper thread while the main thread captures a CUDA graph.

One process plays the FFN: for each phase of a warm-up (an eager step, a capture through
`GraphPool`, a replay) it starts a pair's setup on a helper thread, as `NcclFFNPlane.admit`
does, and lets the peer join while that phase is open on the main thread. A second process
is the attention end of each pair. Asserted per phase: the pair is built, the graph captured
and replayed gives the eager result, and the pair carries a tensor both ways. Skipped without
a GPU (two, or one with AFD_GPU_SHARE_ONE=1); the CPU twin is tests/runtime/test_nccl_pair_capture.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from tests.gpu.nccl_env import gpu_env, nccl_pairs

PHASES = ("eager", "capture", "replay")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@nccl_pairs
def test_pair_setup_during_every_warmup_phase_leaves_captures_whole():
    env = {**os.environ, **gpu_env("pair-ffn", 1)}
    run = subprocess.run([sys.executable, "-m", "tests.gpu.test_gpu_pair_capture", "ffn"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    print(run.stdout[-4000:], run.stderr[-4000:])
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stderr[-2000:]
    assert [r["phase"] for r in results] == list(PHASES)
    assert all(r["pair"] == "built" and r["graph"] == "equal" and r["exchange"] == "equal" for r in results), results


def _exchange(comm, tensor, first_send: bool):
    """FFN end sends `tensor` and receives it doubled; the peer receives, doubles and sends back."""
    import torch
    from afd.connector.transports.nccl.lib import Group

    if first_send:
        with Group():
            comm.send(tensor)
        back = torch.empty_like(tensor)
        with Group():
            comm.recv(back)
        torch.cuda.synchronize()
        return back
    with Group():
        comm.recv(tensor)
    torch.cuda.synchronize()
    doubled = tensor * 2
    with Group():
        comm.send(doubled)
    torch.cuda.synchronize()
    return doubled


def _peer() -> None:
    import torch
    from afd.connector.transports.nccl.lib import PairComm, UniqueId

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    comms = []
    for line in sys.stdin:
        comm = PairComm(UniqueId.from_hex(line.strip()), 1, device)
        _exchange(comm, torch.empty(1024, dtype=torch.float32, device=device), first_send=False)
        comms.append(comm)


def _ffn() -> int:
    import torch
    from afd.connector.transports.nccl.lib import PairComm, new_unique_id
    from afd.graphs.capture import GraphPool

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    peer = subprocess.Popen([sys.executable, "-m", "tests.gpu.test_gpu_pair_capture", "peer"], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, env={**os.environ, **gpu_env("pair-attention", 0)})
    x = torch.randn(512, 512, device=device) / 16
    out = torch.empty_like(x)
    pool, graph, failed = GraphPool(device), None, False

    try:
        for index, phase in enumerate(PHASES):
            uid, box = new_unique_id(), {}

            def setup() -> None:
                try:
                    box["comm"] = PairComm(uid, 0, device)
                except BaseException as err:  # noqa: BLE001 (reported below, the phase fails)
                    box["error"] = repr(err)

            helper = threading.Thread(target=setup, name=f"nccl-init-{phase}", daemon=True)

            def peer_joins() -> None:  # while the phase is open on this thread
                helper.start()
                peer.stdin.write(uid.to_hex() + "\n")
                peer.stdin.flush()
                helper.join(120)

            def step() -> None:
                out.copy_((x @ x).relu() @ x)

            result = {"phase": phase}
            try:
                if phase == "eager":
                    step()
                    peer_joins()
                elif phase == "capture":
                    def recorded() -> None:
                        step()
                        peer_joins()
                    graph = pool.capture(recorded)
                else:
                    graph.replay()
                    peer_joins()
                if graph is not None and phase != "eager":
                    graph.replay()
                torch.cuda.synchronize()
                expected = (x @ x).relu() @ x
                result["graph"] = "equal" if torch.allclose(out, expected, rtol=1e-3, atol=1e-3) else "differs"
            except Exception as err:  # noqa: BLE001
                result["graph"] = f"failed: {err!r}"[:300]
            result["pair"] = "built" if "comm" in box else box.get("error", "setup still running")[:300]
            if "comm" in box:
                sent = torch.full((1024,), float(index + 1), device=device)
                back = _exchange(box["comm"], sent, first_send=True)
                result["exchange"] = "equal" if torch.equal(back, sent * 2) else "differs"
            else:
                result["exchange"] = "no pair"
            print(json.dumps(result), flush=True)
            if result["graph"] != "equal" or "comm" not in box:
                failed = True
                break
    finally:
        peer.stdin.close()
        try:
            peer.wait(30 if not failed else 1)
        except subprocess.TimeoutExpired:
            peer.kill()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_ffn() if sys.argv[1] == "ffn" else _peer())

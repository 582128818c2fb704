"""The NCCL attention plane's step marks: a step that ended before a lost pair was aborted is read, one the
abort cut short fails its wait with PeerLost (no GPU needed: the marks' events are stand-ins)."""

import pytest

from afd.connector.base import PeerLost
from afd.connector.transports.nccl.attention import NcclAttentionPlane, StepMark
from afd.connector.plane import PlaneOptions


class Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_abort_cuts_only_the_steps_still_running():
    plane = NcclAttentionPlane(PlaneOptions("cpu", peer_timeout_s=1.0))
    finished, running = StepMark(Event(True)), StepMark(Event(False))
    plane._open = [finished, running]  # two steps launched, the older one done on the device
    plane.abort()  # the pair is lost (no communicator here: nothing else to tear down)
    assert not finished.cut and running.cut
    plane.finish_step(finished, tick=lambda: None)  # its tokens are good
    running.event.done = True  # the abort drained the stream: the event completes, the results are garbage
    with pytest.raises(PeerLost, match="lost before the step's transfers finished"):
        plane.finish_step(running, tick=lambda: None)

"""The engine's link keeper logs a planned stop of its FFN rank at INFO, a loss at ERROR (issue 35.8);
`afd up` names how each rank ended."""

import logging
import signal

from afd.connector.base import PeerLeft, PeerLost
from afd.engine.recovery.link_care import LinkCare
from afd.local.children import exit_summary


def test_a_goodbye_is_info_a_loss_is_error(caplog):
    caplog.set_level(logging.INFO, logger="afd.engine.recovery.link_care")
    left, lost = LinkCare(link=None, check_s=1.0), LinkCare(link=None, check_s=1.0)
    left.lose(PeerLeft("ffn rank 0 closed the link: ffn rank shutting down"))
    lost.lose(PeerLost("ffn rank 0 is gone: connection reset"))
    levels = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert [level for level, _ in levels] == ["INFO", "ERROR"], levels
    assert "shutting down" in levels[0][1] and "connection reset" in levels[1][1]
    assert left.error and "shutting down" in left.error  # still refused until the FFN rank is back


def test_exit_summary_names_codes_and_signals():
    summary = exit_summary({"attention-0": 0, "attention-1": -signal.SIGTERM, "ffn-0": 1, "ffn-1": None})
    assert summary == "attention-0 exit 0, attention-1 killed by SIGTERM, ffn-0 exit 1, ffn-1 still running"

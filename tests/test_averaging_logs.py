"""hivemind's reports of a failed state download and of a failed all-reduce part (peer/averaging.py); no network."""

import logging
import sys

from peer.averaging import DonorFailureFilter

PEER = "QmTr7SJ1XGEBGYivYmVh3LZZTiXRGkLU6zwh8fttpgkxmV"


def _record(error: BaseException, *, name: str = "swarmpipe-test-averager") -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        exc_info = sys.exc_info()
    return logging.LogRecord(
        name, logging.ERROR, __file__, 1, f"Failed to download state from {PEER} - {error!r}", None, exc_info
    )


def test_a_dead_donor_is_one_warning_line_without_traceback():
    logging.getLogger("swarmpipe-test-averager").setLevel(logging.INFO)
    for error in (TimeoutError(), ConnectionResetError("reset by peer"), EOFError()):
        rec = _record(error)
        assert DonorFailureFilter().filter(rec)
        assert rec.levelno == logging.WARNING and rec.levelname == logging.getLevelName(logging.WARNING)
        assert rec.exc_info is None and rec.exc_text is None
        text = rec.getMessage()
        assert PEER in text and type(error).__name__ in text and "\n" not in text
        assert "Traceback" not in logging.Formatter().format(rec)


def test_the_p2p_daemon_errors_of_an_unreachable_donor_are_one_line_too():
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

    for error in (
        P2PDaemonError("failed to dial"),
        P2PHandlerError("state requested before the peer holds any"),
    ):
        rec = _record(error)
        assert DonorFailureFilter().filter(rec)
        assert rec.exc_info is None and str(error) in rec.getMessage()


def test_other_errors_keep_their_traceback_and_level():
    rec = _record(ValueError("malformed tensor part"))
    assert DonorFailureFilter().filter(rec)
    assert rec.levelno == logging.ERROR and rec.exc_info is not None
    assert "Traceback" in logging.Formatter().format(rec)


def test_unrelated_records_pass_unchanged():
    rec = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "Downloading parameters from peer %s", (PEER,), None
    )
    assert DonorFailureFilter().filter(rec) and rec.levelno == logging.INFO and rec.args == (PEER,)


def test_a_logger_set_above_warning_drops_the_shortened_line():
    logging.getLogger("swarmpipe-test-quiet").setLevel(logging.ERROR)
    assert not DonorFailureFilter().filter(_record(TimeoutError(), name="swarmpipe-test-quiet"))


def _debug(msg: str, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("hivemind.averaging.allreduce", logging.DEBUG, __file__, 1, msg, None, exc_info)


def test_a_failed_all_reduce_part_becomes_one_warning_and_other_debug_lines_stay_out():
    from peer.averaging import AllreduceFailureFilter

    try:
        raise TimeoutError()
    except TimeoutError:
        exc_info = sys.exc_info()
    rec = _debug(f"Caught {TimeoutError()!r} when communicating to {PEER}", exc_info)
    assert AllreduceFailureFilter().filter(rec)
    assert rec.levelno == logging.WARNING and rec.exc_info is None
    assert rec.getMessage() == (
        f"all-reduce: the exchange with {PEER} failed: TimeoutError() (that span keeps this replica's values)"
    )
    assert "Traceback" not in logging.Formatter().format(rec)
    assert AllreduceFailureFilter().filter(_debug(f"Caught ValueError('x') when communicating with {PEER}"))
    assert not AllreduceFailureFilter().filter(_debug("AllReduceRunner(...) - finished"))
    warning = _debug("something hivemind warns about")
    warning.levelno = logging.WARNING
    assert (
        AllreduceFailureFilter().filter(warning) and warning.getMessage() == "something hivemind warns about"
    )

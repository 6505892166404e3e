"""A recipe run in the pytest process (tests/recipes/test_blended_recipe.py) installs its SIGTERM
handler; processes forked later inherit it. The full suite once hung there: the preprocessing
pool's workers, waiting for its queue's lock when the pool was left, kept running through
Pool.terminate()'s SIGTERM. Both ends are closed: the recipe puts the handlers back, and the
pool's workers take SIGTERM's default whatever their parent has."""

from __future__ import annotations

import signal

from megazero.data.preprocess import ordered_map
from megazero.training import StopSignal


def _noop() -> None:
    pass


def _sigterm_is_default(_item) -> bool:
    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_stop_signal_puts_back_the_handlers_it_replaced():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    stop = StopSignal()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


def test_pool_workers_die_on_sigterm_whatever_the_parent_handles():
    stop = StopSignal()  # the parent catches SIGTERM, as a recipe run in-process does
    try:
        assert list(ordered_map(_sigterm_is_default, range(4), 2, _noop, ())) == [True] * 4
    finally:
        stop.restore()

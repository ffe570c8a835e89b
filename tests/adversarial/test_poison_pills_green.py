"""Poison pills on the green pools (gevent, eventlet): the scenario of test_poison_pills_shared.py.

Apart from the threads runs so that the suite's workers (``--dist loadfile``) run them side by
side. Given two supervised ``-c 4`` workers of a green pool and pills mixed with innocents in
every canvas shape, then no innocent is dead and each pill is dead by deaths of its own.
"""
from __future__ import annotations

import pytest

from tests.adversarial.test_poison_pills_shared import scenario


@pytest.mark.slow
@pytest.mark.parametrize("pool,seed", [("gevent", 1), pytest.param("gevent", 2, marks=pytest.mark.long),
                                       pytest.param("eventlet", 1, marks=pytest.mark.long)])
def test_pills_take_no_innocent_down_on_a_green_pool(tmp_path, pool, seed):
    counts = scenario(tmp_path, pool=pool, seed=seed)
    print(counts.line())
    counts.assert_clean(**{"innocents dead": 0, "pills not dead by their own deaths": 0})

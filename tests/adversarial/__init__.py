"""The adversarial suite: one scripted run on real processes per weakness (issue #14's list).

One module per scenario (``test_<name>.py``), each with ``scenario(run, long)``
returning the same counts (``runner.Counts``); a quick form of each runs under
``make test`` and asserts nothing lost, no duplicate accepted, no waiter misled.
``python -m tests.adversarial [--long] [NAME ...]`` (``make adversarial``) runs
them as scripts and prints one table. docs/chaos.md has the results.
"""

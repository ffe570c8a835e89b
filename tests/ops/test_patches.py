"""Every change the package makes to Celery's and kombu's code is named in one place and undone.

Run in a fresh interpreter: undoing the patches of the suite's own process would pull them
from under the other tests.
"""
from __future__ import annotations

import json

from tests.support.processes import run_fresh

SCRIPT = r'''
import json
import kombu.messaging, kombu.transport.redis as kr
from celery import Celery, canvas
from celery.bin import base as cli        # loaded first, as in the `celery` program
from celery.worker import control
import celery_leases
from celery_leases import patches
from celery_leases.testing import undo_patches
from celery_leases.worker import held, revokes
from celery_leases.publishing import one_call

before = {"dumps": kombu.messaging.dumps, "apply": canvas.group._apply_tasks, "put": kr.Channel._put,
          "qos": kr.Channel.QoS, "revoke": control.Panel.data["revoke"], "pretty": cli.CLIContext.pretty}
app = Celery("p", broker="redis://127.0.0.1:1/0")
celery_leases.install(app)
import celery_leases.cli           # Celery's command line: its celery.commands entry point
one_call.install()                 # an app's first recorded publish (one Redis)
held.install()                     # a worker's LeaseStep on a Redis broker
revokes.install_control_hook()     # a worker
changed = {k: v is not {"dumps": kombu.messaging.dumps, "apply": canvas.group._apply_tasks,
                        "put": kr.Channel._put, "qos": kr.Channel.QoS,
                        "revoke": control.Panel.data["revoke"],
                        "pretty": cli.CLIContext.pretty}[k] for k, v in before.items()}
names = undo_patches()
after = {"dumps": kombu.messaging.dumps, "apply": canvas.group._apply_tasks, "put": kr.Channel._put,
         "qos": kr.Channel.QoS, "revoke": control.Panel.data["revoke"], "pretty": cli.CLIContext.pretty}
print(json.dumps({"changed": changed, "names": names,
                  "restored": {k: after[k] is before[k] for k in before}, "left": patches.installed()}))
'''


def test_install_patches_are_named_in_one_place_and_undone():
    # Given a fresh interpreter where install(app), Celery's command line (its entry point), the one-call
    # publish, the worker's held deliveries and its revoke hook have changed Celery's and kombu's code
    report = json.loads(run_fresh(SCRIPT).strip().splitlines()[-1])
    # Then each change is one of patches.py's names
    assert all(report["changed"].values()), report
    assert report["names"] == sorted(["kombu.messaging.dumps", "celery.canvas.group._apply_tasks",
                                      "kombu.transport.redis.Channel._put",
                                      "kombu.transport.redis.Channel.QoS",
                                      "celery.worker.control.Panel[revoke]",
                                      "celery.bin.base.CLIContext.pretty"])
    # And undo_patches puts every original back, leaving nothing installed
    assert all(report["restored"].values()), report
    assert report["left"] == []


def test_install_outside_the_command_line_leaves_celerys_printing_alone():
    # Given a fresh interpreter that is not Celery's command line (a web process, say)
    script = ("import sys; from celery import Celery; import celery_leases\n"
              "celery_leases.install(Celery('p', broker='redis://127.0.0.1:1/0'))\n"
              "print('celery.bin.base' in sys.modules, celery_leases.patches.installed())")
    # When it calls install(app)
    out = run_fresh(script)
    # Then neither Celery's command line is imported nor its printing changed
    assert out.split()[0] == "False" and "CLIContext" not in out, out

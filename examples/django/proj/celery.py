"""proj/celery.py: the Celery app of a Django project, with celery-leases.

In a Django project the settings object is Django's::

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.autodiscover_tasks()        # tasks.py of every INSTALLED_APPS entry

This example runs without Django installed, so it hands Celery the settings
module itself: ``config_from_object`` reads a plain module the same way, with
the same ``CELERY_`` namespace, so what it prints is what Django would give.
"""
from celery import Celery

import celery_leases

app = Celery("proj")
app.config_from_object("proj.settings", namespace="CELERY")   # Django: "django.conf:settings"
celery_leases.install(app)     # after config_from_object; reads CELERY_LEASES_* when configured
app.autodiscover_tasks(["proj"])                               # Django: app.autodiscover_tasks()

"""The Celery worker wiring: bootsteps and the services they start.

Importing this package loads nothing; each module is imported by name
(``install(app)`` imports the bootsteps).
"""

"""``edge-fl dashboard``: one page that watches a job live (over the broker) or a run directory.

docs/dashboard.md says what it shows, how the page gets its data (a server-sent-events relay in
this process) and who may see what.
"""

from edge_fl.dashboard.app import Dashboard

__all__ = ["Dashboard"]

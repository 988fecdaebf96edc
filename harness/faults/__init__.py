"""The production layout and its faults (issue 21; issue 34, "Faults"):

- layout.py: two `quotes.ops.server` daphnes behind nginx (deploy/nginx's rules), a real
  PostgreSQL and Redis, the fake Workers AI upstream; each part can be stopped, paused, killed or
  restarted as deploy/rolling-restart does;
- load.py: clients, each on its own loopback address with a csrftoken cookie of its own, asking
  for quotes one after another and timing every byte;
- faults.py: the faults, and one run of each (load, inject, recover, settle, check).

tests/faults/test_faults.py and tests/deploy/test_scaleout.py run them briefly; bench/faults.py
runs them longer.
"""

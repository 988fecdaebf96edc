"""The fault suite (issue 21): the production layout under load while the database, Redis, a
daphne process or the upstream fails, and the checks that nothing is lost meanwhile.

- layout.py: two `quotes.server` daphnes behind nginx (deploy/nginx's rules), a real PostgreSQL
  and Redis, the fake Workers AI upstream; each service can be stopped, paused or killed;
- load.py: clients, each on its own loopback address, asking for quotes one after another and
  timing every byte;
- faults.py: the faults, and one run of each (load, inject, recover, settle, check).

tests/faults/test_faults.py runs each fault briefly in CI; bench/faults.py runs them longer.
"""

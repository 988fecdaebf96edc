"""What the tests and the benchmarks share: the servers they start and the clients they read with.

- services.py: PostgreSQL, Redis and nginx from the Debian packages (nginx's site built from
  deploy/nginx), free ports, loopback client addresses; `python -m harness.services -- CMD`;
- daphne.py: daphne as the deploy files start it, and any other server started and waited for;
- workers_ai.py: the fake Workers AI upstream and its scenarios (and a keep-alive variant);
- openai.py: a scripted OpenAI-compatible upstream;
- sse.py: the client's SSE reader;
- scaleout.py: the scale-out check (`make scaleout`); faults/: the fault suite's layout and load.

bench/ imports from here, never from tests/.
"""

"""What the tests and the benchmarks share: the servers they start and the clients they read with.

- services.py: PostgreSQL, Redis and nginx from the Debian packages (nginx's site built from
  deploy/nginx), free ports, loopback client addresses; `python -m harness.services -- CMD`;
- daphne.py: daphne as the deploy files start it, and any other server started and waited for;
- workers_ai.py: the fake Workers AI upstream and its scenarios (and a keep-alive variant);
- openai.py: a scripted OpenAI-compatible upstream;
- sse.py: the client's SSE reader, and a small WebSocket client;
- faults/: the production layout (two daphnes behind deploy/nginx, PostgreSQL, Redis), its
  clients and its faults; scaleout.py: its checks (`make scaleout`) and the one layout the
  system tests share.

bench/ imports from here, never from tests/.
"""

"""`python -m tests.faults.fake_server [MIB]`: the real rollout-server app over the fake echo engine (MIB
MiB of float32 weights, default 1) on a free loopback port, for fault tests that need the server in its
own process (to kill it) without a model to load."""

from __future__ import annotations

import sys

from stagectl.engines.fake import FakeEngine, default_weights
from stagectl.server.app import build_app
from stagectl.server.service import RolloutService, ServerSettings
from stagectl.server.serving import bind_socket, serve

if __name__ == "__main__":
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    engine = FakeEngine(default_weights(num_mib=mib, block_mib=1))
    serve(build_app(RolloutService(engine, ServerSettings())), bind_socket("127.0.0.1", 0))

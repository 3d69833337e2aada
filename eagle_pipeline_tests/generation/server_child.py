"""Child process that runs a simulated OpenRouter server for a test, so the server's clock and event loop share no
interpreter (no GIL) with the test or the client: its stamps of when an answer's last byte was written are not delayed
by their work.

python -m eagle_pipeline_tests.generation.server_child SERVER_KWARGS_JSON

Prints the server's URL on one line, then answers one JSON request per stdin line with one JSON line on stdout:
{"call": "answered", "since": I} (the answered stamps from the I-th on, as [key, attempt, t]), {"call": "read_by",
"since": I} (likewise), {"call": "arrivals", "since": I}, {"call": "open_connections"}, {"call": "request_counts"}. The server stops when stdin closes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from eagle_pipeline.simulation import SimulatedOpenRouterServer


def answer(srv: SimulatedOpenRouterServer, req: dict[str, Any]) -> Any:
    call = req["call"]
    if call == "answered":  # insertion order is the order the answers were written
        return [[k, a, t] for (k, a), t in list(srv.answered_at().items())[req.get("since", 0) :]]
    if call == "read_by":  # insertion order is the order the proofs arrived
        return [[k, a, t] for (k, a), t in list(srv.read_by().items())[req.get("since", 0) :]]
    if call == "arrivals":
        return srv.arrivals()[req.get("since", 0) :]
    if call == "open_connections":
        return srv.open_connections()
    if call == "request_counts":
        return srv.request_counts()
    raise ValueError(f"unknown call {call!r}")


def main() -> None:
    with SimulatedOpenRouterServer(**json.loads(sys.argv[1])) as srv:
        print(srv.url, flush=True)
        for line in sys.stdin:
            print(json.dumps(answer(srv, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()

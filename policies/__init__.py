"""The routing decision: request features, the latency model and the routing policies."""

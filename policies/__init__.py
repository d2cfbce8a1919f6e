"""The routing decision, pure: request features, the latency model, output-length prediction, the
routing policies and the policy document. No I/O, no clock, no randomness: time and state come in
as arguments, so the gateway and the offline simulator run the very same code."""

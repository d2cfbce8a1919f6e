"""The calibrated simulated vLLM replica: engine model, metrics and HTTP face (`specgate sim`)."""

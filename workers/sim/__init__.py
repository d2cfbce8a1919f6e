"""A calibrated simulated vLLM replica: engine model, profiles, metrics and HTTP face."""

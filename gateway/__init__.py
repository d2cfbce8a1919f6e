"""specgate's HTTP face: the OpenAI-compatible gateway, its admin API, metrics, and the policy
store it follows."""

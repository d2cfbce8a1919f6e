"""specgate's HTTP face: the OpenAI-compatible gateway, its admin API and the command line."""

"""What every specgate server and client shares about the wire, a leaf: vLLM's OpenAI endpoints,
how big a prompt is in tokens, and how an aiohttp application is served. Imports nothing else of
specgate."""

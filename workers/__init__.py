"""The replicas: pools, scraping, launching real vLLM servers, and the simulated vLLM replica."""

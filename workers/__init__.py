"""The gateway's view of its replicas: live state and health, scraping, acceptance, and launching
replica processes (simulated or real vLLM)."""

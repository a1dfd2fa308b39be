"""`llama-ane serve`: an OpenAI-compatible HTTP server over one export (app.py), whose concurrent
requests share prefixes as cascade branches (scheduler.py), with a prompt-cache LRU
(prompt_cache.py) and grammar-constrained JSON output (constraints.py)."""

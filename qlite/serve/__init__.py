"""Serving: the continuous-batching engine (engine.py, with the prompt cache of prompt_cache.py), the
OpenAI API's request and answer shapes (openai_api.py, tool calls in tools.py) and the HTTP server over
them (server.py, and its chat page webui.html). Within qlite only the CLI imports this package
(tests/test_imports.py)."""

"""OpenAI-compatible HTTP server of an attention rank (FastAPI on uvicorn)."""

"""llm-pool: one OpenAI-compatible endpoint in front of many LLM runtimes under supervisord."""

"""Small OpenAI-compatible servers for engines that have none of their own; one module per engine."""

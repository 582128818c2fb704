"""The serving processes through the OpenAI API (CPU and GPU), their profiles, the engine loop and the output path."""

"""The serverless face: the worker's settings (every environment variable, handler.config), the
RunPod worker (`python -m handler`) and the OpenAI HTTP server (`python -m handler serve`), both
serving one implementation of the OpenAI routes over the engine.

Imports engine, cache and warmup. docs/architecture.md lists its modules.
"""

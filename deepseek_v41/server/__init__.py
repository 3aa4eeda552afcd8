"""The OpenAI-compatible HTTP server (SPEC.md §4.6): FastAPI routes over
:class:`~deepseek_v41.engine.async_engine.AsyncLLMEngine`; HTTP only, no model logic.

``dsv41 serve`` starts it; ``deepseek_v41.server.app.build_app(engine, ServerConfig(...))`` builds it in-process.
Nothing is imported here, so that the command line stays fast.
"""
